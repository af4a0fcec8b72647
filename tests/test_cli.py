"""Tests of the ``hf-relpos`` command line: train, generate, eval, validate-t5, compare.

Every run is tiny (preset ``tiny``, a few steps, L = 16 or 32, a 300-token BPE) and in-process
(``hf_relpos_cli.main``) so that the whole file stays well under a minute and a half on two CPU
cores. Nothing is downloaded: the corpus is Python's bundled documentation and every output lives
under pytest's temporary folders.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_relpos
import hf_relpos.functional_relpos
import hf_relpos.position_terms_relpos
import hf_relpos.commands.compare
import hf_relpos_cli
from hf_relpos.commands.common import RUN_FILE
from hf_relpos.commands.model_card import BIBTEX
from hf_relpos.commands.train import PRESETS
from hf_relpos.data import embedded_corpus, encode
from hf_relpos.memory import segment_perplexity

# One pytest-xdist worker runs this whole module (make test: --dist loadgroup): its shared fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_cli")

torch.set_num_threads(1)

PACKAGE_DIR = Path(hf_relpos.__file__).resolve().parent
CODE_FILES = ("configuration_relpos.py", "modeling_relpos.py", "generation_relpos.py", "inputs_relpos.py",
              "loading_relpos.py", "position_context_relpos.py", "attention_backends_relpos.py",
              "position_schemes_relpos.py", "functional_relpos.py", "position_terms_relpos.py", "kernels_relpos.py",
              "bias_kernels_relpos.py",
              "attention_utils_relpos.py", "model_card_relpos.py")
AUTO_MAP_KEYS = ("AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification")
SUBCOMMANDS = ("train", "generate", "eval", "validate-t5", "compare", "inspect")
SCHEME_TAG = {"t5_bias": "t5-bias", "transformer_xl": "transformer-xl", "learned": "learned-absolute"}
PROMPT = "The function"

# (seq_len, steps, eval_tokens) per scheme trained by the module fixtures
SETTINGS = {"t5_bias": (16, 4, 200), "learned": (16, 3, 200), "transformer_xl": (32, 3, 300)}


def tiny_args(scheme, folder, *, seq_len, steps, eval_tokens, extra=()):
    return [
        "train", "--position-encoding", scheme, "--output-dir", str(folder),
        "--steps", str(steps), "--seq-len", str(seq_len), "--batch-size", "4", "--vocab-size", "300",
        "--eval-tokens", str(eval_tokens), "--quiet", *extra,
    ]  # fmt: skip


def train_folder(tmp_path_factory, scheme) -> Path:
    seq_len, steps, eval_tokens = SETTINGS[scheme]
    folder = tmp_path_factory.mktemp(f"cli-{scheme}") / scheme
    assert hf_relpos_cli.main(tiny_args(scheme, folder, seq_len=seq_len, steps=steps, eval_tokens=eval_tokens)) == 0
    return folder


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
    return train_folder(tmp_path_factory, "t5_bias")


@pytest.fixture(scope="module")
def learned_folder(tmp_path_factory):
    return train_folder(tmp_path_factory, "learned")


@pytest.fixture(scope="module")
def txl_folder(tmp_path_factory):
    return train_folder(tmp_path_factory, "transformer_xl")


def read_run(folder: Path) -> dict:
    return json.loads((folder / RUN_FILE).read_text())


def front_matter(card: str) -> dict:
    match = re.match(r"\A---\n(.*?)\n---\n", card, re.S)
    assert match, "README.md does not open with a YAML front matter block"
    return yaml.safe_load(match.group(1))


def parse_eval(stdout: str) -> dict:
    """``hf-relpos eval`` lines ``ppl@N: value`` (and ``ppl@N+memoryM: value``) -> {name: text}."""
    return dict(re.findall(r"^\s*(ppl@\S+): (\S+)\s*$", stdout, re.M))


# ---------------------------------------------------------------------------
# 1. train writes a Hub-ready folder
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["t5_bias", "transformer_xl"])
def test_train_writes_hub_ready_folder(scheme, request):
    folder = request.getfixturevalue({"t5_bias": "t5_folder", "transformer_xl": "txl_folder"}[scheme])
    seq_len, steps, eval_tokens = SETTINGS[scheme]
    names = {p.name for p in folder.iterdir()}

    # weights: safetensors only
    assert "model.safetensors" in names
    assert not [n for n in names if n.endswith(".bin") or n.startswith("pytorch_model")], names

    # config with a complete auto_map pointing at code files that ship in the folder
    config = json.loads((folder / "config.json").read_text())
    assert config["position_encoding"] == scheme
    auto_map = config.get("auto_map", {})
    assert set(AUTO_MAP_KEYS) <= set(auto_map), auto_map
    for key in AUTO_MAP_KEYS:
        module, _, cls = auto_map[key].partition(".")
        assert (folder / f"{module}.py").is_file(), auto_map[key]
        assert f"class {cls}(" in (folder / f"{module}.py").read_text(), auto_map[key]
    for name in CODE_FILES:
        assert (folder / name).read_bytes() == (PACKAGE_DIR / name).read_bytes(), f"{name} differs from the package"

    # tokenizer loadable by AutoTokenizer, matching the model's vocabulary
    run = read_run(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == config["vocab_size"] == run["vocab_size"]
    assert tokenizer.eos_token_id == config["eos_token_id"] and tokenizer.pad_token_id == config["pad_token_id"]
    text = "def f(x):\n    return x + 1"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text

    # the run summary is what was asked for
    assert run["position_encoding"] == scheme
    assert (run["steps"], run["seq_len"], run["batch_size"], run["test_tokens"]) == (steps, seq_len, 4, eval_tokens)
    assert math.isfinite(run["test_ppl"]) and run["test_ppl"] > 1
    assert 0 < run["position_parameters"] < run["parameters"]

    # model card: front matter, real numbers, no placeholder left
    card = (folder / "README.md").read_text()
    meta = front_matter(card)
    assert meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-generation"
    assert "custom_code" in meta["tags"] and SCHEME_TAG[scheme] in meta["tags"], meta["tags"]
    assert "{{" not in card and "}}" not in card
    assert f"Test perplexity ({eval_tokens:,} held-out tokens" in card
    for factor in (1, 2, 4):  # the evaluation at L, 2L, 4L, in the table and as model-index metrics
        value = run["test_ppl_by_length"][str(factor * seq_len)]
        assert f"| {factor * seq_len} ({factor}L) | {value:.2f} |" in card
    metrics = meta["model-index"][0]["results"][0]["metrics"]
    assert [m["value"] for m in metrics[:3]] == [round(run["test_ppl_by_length"][str(f * seq_len)], 4) for f in (1, 2, 4)]
    assert all(m["type"] == "perplexity" for m in metrics)
    assert f"Command: `{run['command']}`" in card and run["command"].startswith("hf-relpos train ")
    assert "```bibtex" in card and BIBTEX[scheme] in card
    assert str(folder.parent) not in card.replace(run["command"], "")  # no local paths beyond the command given
    assert f"| steps × batch | {steps} × 4," in card
    assert f"{run['train_tokens']:,}" in card and f"{run['parameters']:,} parameters" in card
    assert f"({run['position_parameters']:,} in the position scheme)" in card
    if scheme == "transformer_xl":
        assert run["mem_len"] == seq_len
        assert math.isfinite(run["test_ppl_with_memory"])
        assert f"| {seq_len} with memory {seq_len} | {run['test_ppl_with_memory']:.2f} |" in card
        assert len(metrics) == 4
        assert f"memory {seq_len}" in card
    else:
        assert "test_ppl_with_memory" not in run and "with memory" not in card

    # checkpoints live next to the model folder, never inside it
    assert not [n for n in names if n.startswith("checkpoint")], names
    checkpoints = folder.parent / f"{folder.name}-checkpoints"
    assert checkpoints.is_dir()
    assert f"checkpoint-{steps}" in {p.name for p in checkpoints.iterdir()}


# ---------------------------------------------------------------------------
# 2. --resume
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme, seq_len", [("t5_bias", 16), ("transformer_xl", 32)])
def test_train_resume_continues_from_last_checkpoint(scheme, seq_len, tmp_path, monkeypatch):
    folder = tmp_path / "model"
    settings = dict(seq_len=seq_len, eval_tokens=200)
    assert hf_relpos_cli.main(tiny_args(scheme, folder, steps=4, **settings)) == 0
    checkpoints = tmp_path / "model-checkpoints"
    assert "checkpoint-4" in {p.name for p in checkpoints.iterdir()}

    # count the optimizer steps the second run really takes, and from which global step
    seen, mems_at_first_step = [], []
    original = transformers.Trainer.training_step

    def spy(self, *args, **kwargs):
        seen.append(self.state.global_step)
        if len(seen) == 1:
            mems_at_first_step.append(getattr(self, "train_mems", None) is not None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "training_step", spy)
    assert hf_relpos_cli.main(tiny_args(scheme, folder, steps=8, extra=["--resume"], **settings)) == 0

    assert seen == [4, 5, 6, 7], f"resumed run should take steps 5..8 only, took global steps {seen}"
    assert read_run(folder)["steps"] == 8
    names = {p.name for p in checkpoints.iterdir()}
    assert "checkpoint-8" in names, names
    state = json.loads((checkpoints / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["global_step"] == 8 and state["max_steps"] == 8
    if scheme == "transformer_xl":  # the memory saved with checkpoint-4 is carried into step 5
        assert mems_at_first_step == [True]
        assert (checkpoints / "checkpoint-8" / "mems-rank0.safetensors").is_file()


# ---------------------------------------------------------------------------
# 3. generate
# ---------------------------------------------------------------------------


def test_generate_greedy_starts_with_prompt_and_matches_model(t5_folder, capsys):
    capsys.readouterr()
    argv = ["generate", str(t5_folder), "--prompt", PROMPT, "--quiet", "--temperature", "0", "--max-new-tokens", "8"]
    assert hf_relpos_cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.endswith("\n")
    text = printed[:-1]
    assert text.startswith(PROMPT), text
    assert len(text) > len(PROMPT), "nothing was generated"

    # the same greedy decoding done by hand through the Auto classes
    tokenizer = AutoTokenizer.from_pretrained(t5_folder)
    model = AutoModelForCausalLM.from_pretrained(t5_folder, trust_remote_code=True).eval()
    inputs = tokenizer(PROMPT, return_tensors="pt", add_special_tokens=False, return_token_type_ids=False)
    output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert text == tokenizer.decode(output[0], skip_special_tokens=True)

    # streaming (not --quiet) prints the prompt and continuation too
    assert hf_relpos_cli.main(argv[:4] + ["--temperature", "0", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith(PROMPT)


def test_model_card_snippet_runs_without_hf_relpos(t5_folder, tmp_path):
    """The card's "How to load" code, run as written in a process that cannot import hf_relpos,
    loads the folder's own code, generates what the installed package generates, and asks nothing."""
    card = (t5_folder / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", card, re.S)
    assert snippet and "path/to/this/folder" in snippet.group(1)
    code = snippet.group(1).replace("path/to/this/folder", str(t5_folder))
    guard = textwrap.dedent(
        """
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "hf_relpos" or name.startswith("hf_relpos."):
                    raise ImportError("hf_relpos is blocked in this process")

        sys.meta_path.insert(0, Block())
        import torch
        torch.set_num_threads(1)
        """
    )
    check = "\nassert 'hf_relpos' not in sys.modules and type(model).__module__.startswith('transformers_modules')\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [sys.executable, "-c", guard + code + check], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]

    # the same snippet in this process, with hf_relpos installed
    tokenizer = AutoTokenizer.from_pretrained(t5_folder)
    model = AutoModelForCausalLM.from_pretrained(t5_folder, trust_remote_code=True)
    inputs = tokenizer("The", return_tensors="pt", return_token_type_ids=False)
    expected = tokenizer.decode(model.generate(**inputs, max_new_tokens=40)[0])
    assert result.stdout.endswith(expected + "\n"), (result.stdout[-500:], expected)
    # nothing interactive: a user pasting the card's code into a terminal must not be asked questions
    assert "Do you wish to run the custom code" not in result.stdout + result.stderr, result.stdout[:600]


# ---------------------------------------------------------------------------
# 4. eval
# ---------------------------------------------------------------------------


def test_eval_t5_bias_finite_at_every_length(t5_folder, capsys):
    capsys.readouterr()
    seq_len, _, eval_tokens = SETTINGS["t5_bias"]
    assert hf_relpos_cli.main(["eval", str(t5_folder), "--eval-tokens", str(eval_tokens)]) == 0
    values = parse_eval(capsys.readouterr().out)
    assert list(values) == [f"ppl@{seq_len * f}" for f in (1, 2, 4)], values
    for name, text in values.items():
        assert math.isfinite(float(text)) and float(text) > 1, (name, text)
    # at L on the same held-out tokens it is the number train reported (and wrote in the card)
    assert values[f"ppl@{seq_len}"] == f"{read_run(t5_folder)['test_ppl']:.2f}"


def test_eval_matches_independent_perplexity(t5_folder, capsys):
    """eval's 2L number is the perplexity of the held-out text, recomputed here without the CLI."""
    capsys.readouterr()
    seq_len, _, _ = SETTINGS["t5_bias"]
    assert hf_relpos_cli.main(["eval", str(t5_folder), "--factors", "2", "--eval-tokens", "300"]) == 0
    values = parse_eval(capsys.readouterr().out)
    tokenizer = AutoTokenizer.from_pretrained(t5_folder)
    model = AutoModelForCausalLM.from_pretrained(t5_folder, trust_remote_code=True).eval()
    stream = encode(tokenizer, embedded_corpus()["test"])
    expected = segment_perplexity(model, stream, 2 * seq_len, use_memory=False, max_tokens=300)
    assert values == {f"ppl@{2 * seq_len}": f"{expected:.2f}"}


def test_eval_learned_is_inf_past_training_length(learned_folder, capsys):
    capsys.readouterr()
    seq_len, _, eval_tokens = SETTINGS["learned"]
    assert json.loads((learned_folder / "config.json").read_text())["max_position_embeddings"] == seq_len
    assert hf_relpos_cli.main(["eval", str(learned_folder), "--eval-tokens", str(eval_tokens)]) == 0
    values = parse_eval(capsys.readouterr().out)
    assert list(values) == [f"ppl@{seq_len * f}" for f in (1, 2, 4)], values
    assert math.isfinite(float(values[f"ppl@{seq_len}"]))
    assert values[f"ppl@{seq_len}"] == f"{read_run(learned_folder)['test_ppl']:.2f}"
    assert values[f"ppl@{2 * seq_len}"] == "inf" and values[f"ppl@{4 * seq_len}"] == "inf", values


def test_eval_transformer_xl_reports_memory(txl_folder, capsys):
    capsys.readouterr()
    seq_len, _, eval_tokens = SETTINGS["transformer_xl"]
    assert hf_relpos_cli.main(["eval", str(txl_folder), "--factors", "1", "--eval-tokens", str(eval_tokens)]) == 0
    values = parse_eval(capsys.readouterr().out)
    run = read_run(txl_folder)
    # Printed with 2 decimals; float32 reductions in a reloaded model may move the last digit.
    assert set(values) == {f"ppl@{seq_len}", f"ppl@{seq_len}+memory{seq_len}"}
    assert float(values[f"ppl@{seq_len}"]) == pytest.approx(run["test_ppl"], abs=0.011)
    assert float(values[f"ppl@{seq_len}+memory{seq_len}"]) == pytest.approx(run["test_ppl_with_memory"], abs=0.011)


def test_eval_rejects_non_positive_factors(t5_folder, capsys):
    """A zero factor is a usage error, not a scheme that "cannot run": it must not print inf."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        hf_relpos_cli.main(["eval", str(t5_folder), "--factors", "1", "0", "--eval-tokens", "50"])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("hf-relpos eval: error: argument --factors: must be >= 1, got 0")
    assert captured.err.count("\n") == 1 and "inf" not in captured.out


# ---------------------------------------------------------------------------
# 5. validate-t5
# ---------------------------------------------------------------------------


def test_validate_t5_ok(capsys):
    assert hf_relpos_cli.main(["validate-t5"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "MISMATCH" not in out
    assert f"transformers {transformers.__version__}" in out
    assert re.search(r"mismatches: 0\b", out), out


def test_validate_t5_detects_broken_buckets(monkeypatch, capsys):
    original = hf_relpos.position_terms_relpos.t5_relative_position_bucket
    signature = inspect.signature(original)

    def off_by_one(*args, **kwargs):  # still a valid bucket index, just the wrong one
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return (original(*args, **kwargs) + 1) % bound.arguments["num_buckets"]

    # validate_t5 imports the name from hf_relpos.position_terms_relpos (where the models' T5 term lives) at call
    # time, and t5_position_bias looks it up in the same module, so both the bucket check and the bias check see
    # the break
    monkeypatch.setattr(hf_relpos.position_terms_relpos, "t5_relative_position_bucket", off_by_one)
    assert hf_relpos_cli.main(["validate-t5"]) != 0
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "OK" not in out
    assert not re.search(r"mismatches: 0\b", out), out


# ---------------------------------------------------------------------------
# 6. compare
# ---------------------------------------------------------------------------


def test_compare_quick_writes_table_json_and_plot(tmp_path, capsys):
    out = tmp_path / "compare"
    schemes = ["t5_bias", "learned", "alibi"]
    seq_len, steps, seeds = 16, 3, 2
    models = out / "models"
    argv = ["compare", "--quick", "--schemes", *schemes, "--output-dir", str(out), "--steps", str(steps),
            "--seq-len", str(seq_len), "--batch-size", "4", "--vocab-size", "300", "--seeds", str(seeds)]  # fmt: skip
    assert hf_relpos_cli.main(argv) == 0
    printed = capsys.readouterr().out

    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.iterdir()) == ["compare.json", "compare.md", "compare.png", "models"]
    data = json.loads((out / "compare.json").read_text())
    table = (out / "compare.md").read_text()
    assert table in printed
    assert data["meta"]["steps"] == steps and data["meta"]["seq_len"] == seq_len
    assert data["meta"]["seeds"] == [0, 1] and data["meta"]["factors"] == [1, 2, 4, 8]
    assert data["meta"]["quick"] is True and table.startswith("**Quick run**")  # a quick run says so

    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| scheme"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    assert columns == ["scheme", "position params", "held-out PPL at L", "2x PPL", "4x PPL", "8x PPL"], columns
    body = []
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        body.append([c.strip() for c in line.strip("|").split("|")])
    assert [row[0] for row in body] == schemes
    assert [row["scheme"] for row in data["rows"]] == schemes

    def cell(row, key):
        if math.isinf(row[key]):
            return "∞ (cannot run: past the position table)"
        return f"{row[key]:.2f} ± {row[key + '_std']:.2f}"

    for cells, row in zip(body, data["rows"]):
        assert cells == [row["scheme"], f"{row['position_params']:,}"] + [cell(row, f"ppl_{f}x") for f in (1, 2, 4, 8)]
        # each length's mean and standard deviation are those of the seeds' own training records
        runs = [read_run(models / row["scheme"] / f"seed-{seed}") for seed in (0, 1)]
        assert [run["seed"] for run in runs] == [0, 1]
        for f in (1, 2, 4, 8):
            values = [run["test_ppl_by_length"][str(f * seq_len)] for run in runs]
            assert row[f"ppl_{f}x_seeds"] == values
            if not any(math.isinf(v) for v in values):
                assert row[f"ppl_{f}x"] == pytest.approx(statistics.mean(values), rel=1e-12)
                assert row[f"ppl_{f}x_std"] == pytest.approx(statistics.stdev(values), rel=1e-9)
        assert runs[0]["test_ppl"] != runs[1]["test_ppl"]  # the seeds differ
        assert runs[0]["position_parameters"] == row["position_params"]
        assert math.isfinite(row["ppl_1x"])

    by_scheme = {cells[0]: cells for cells in body}
    assert all("∞" in c for c in by_scheme["learned"][3:])
    for scheme in ("t5_bias", "alibi"):
        assert "∞" not in "".join(by_scheme[scheme]), by_scheme[scheme]
    rows = {row["scheme"]: row for row in data["rows"]}
    assert all(math.isinf(rows["learned"][f"ppl_{f}x"]) for f in (2, 4, 8))
    assert rows["alibi"]["position_params"] == 0  # parameter-free
    assert rows["learned"]["position_params"] == seq_len * PRESETS["tiny"]["hidden_size"]


def test_sliding_perplexity_scores_every_token_once_with_its_window():
    """Sliding evaluation against a direct loop: token t is predicted from the window that first covers it."""
    from hf_relpos.memory import sliding_perplexity

    class Unigram(torch.nn.Module):  # logits depend on the context length seen: shows which window scored
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, use_cache=False):
            n = input_ids.shape[1]
            logits = torch.arange(11.0)[None, None].expand(1, n, 11) * torch.arange(1.0, n + 1)[None, :, None] * 0.1
            return type("Out", (), {"logits": logits})()

    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7])
    window, stride = 6, 2
    nll, count = 0.0, 0
    for t in range(1, len(ids)):  # token t: the first window [s, e) with e >= t, e - s <= window
        e = min(window, len(ids) - 1) if t <= window else window + ((t - window + stride - 1) // stride) * stride
        e = min(e, len(ids) - 1)
        s = max(0, e - window)
        logits = Unigram()(ids[None, s:e]).logits[0]
        nll -= torch.log_softmax(logits[t - 1 - s], -1)[ids[t]].item()
        count += 1
    expected = math.exp(nll / count)
    assert sliding_perplexity(Unigram(), ids, window, stride) == pytest.approx(expected, rel=1e-6)  # float32 sums


def test_compare_quick_caps_but_keeps_smaller_user_settings(monkeypatch, tmp_path):
    """--quick shortens the run; it must not override smaller values the user asked for."""
    seen = []

    class Stop(Exception):
        pass

    def record(args):
        seen.append(args)
        raise Stop

    monkeypatch.setattr(hf_relpos.commands.compare, "train_model", record)
    with pytest.raises(Stop):
        hf_relpos_cli.main(["compare", "--quick", "--output-dir", str(tmp_path / "a")])
    assert (seen[-1].steps, seen[-1].seq_len) == (60, 64)
    assert seen[-1].eval_tokens == 4096
    with pytest.raises(Stop):
        hf_relpos_cli.main(["compare", "--quick", "--steps", "3", "--seq-len", "16", "--eval-tokens", "400",
                  "--output-dir", str(tmp_path / "b")])
    assert (seen[-1].steps, seen[-1].seq_len) == (3, 16)
    assert seen[-1].eval_tokens == 400, f"--quick replaced --eval-tokens 400 by {seen[-1].eval_tokens}"


# ---------------------------------------------------------------------------
# 7. bad arguments
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["train", "--steps", "0"], "--steps"),
        (["train", "--seq-len", "-1"], "--seq-len"),
        (["train", "--batch-size", "0"], "--batch-size"),
        (["train", "--vocab-size", "0"], "--vocab-size"),
        (["compare", "--steps", "0"], "--steps"),
        (["eval", "some-folder", "--seq-len", "0"], "--seq-len"),
        (["generate", "some-folder", "--max-new-tokens", "0"], "--max-new-tokens"),
    ],
)
def test_non_positive_arguments_exit_naming_the_flag(argv, flag, tmp_path, capsys):
    output = tmp_path / "never"
    if argv[0] in ("train", "compare"):
        argv = argv + ["--output-dir", str(output)]
    with pytest.raises(SystemExit) as info:
        hf_relpos_cli.main(argv)
    message = capsys.readouterr().err
    assert info.value.code == 2
    assert message.startswith(f"hf-relpos {argv[0]}: error: argument {flag}") and "must be >= " in message, message
    assert message.count("\n") == 1, message  # one line, no usage block
    assert not output.exists()


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"hf-relpos {command}: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def test_generate_and_eval_need_a_trained_folder(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert hf_relpos_cli.main(["generate", str(empty), "--quiet"]) == 2
    assert str(empty) in one_line_error(capsys, "generate")
    assert hf_relpos_cli.main(["eval", str(empty)]) == 2
    assert "config.json" in one_line_error(capsys, "eval")
    missing = tmp_path / "missing"
    assert hf_relpos_cli.main(["generate", str(missing)]) == 2
    assert str(missing) in one_line_error(capsys, "generate")


def test_train_file_errors_name_the_flag(tmp_path, capsys):
    missing = tmp_path / "nope.txt"
    argv = ["train", "--output-dir", str(tmp_path / "m"), "--steps", "1", "--seq-len", "16", "--quiet"]
    assert hf_relpos_cli.main(argv + ["--train-file", str(missing)]) == 2
    err = one_line_error(capsys, "train")
    assert "--train-file" in err and str(missing) in err
    short = tmp_path / "short.txt"
    short.write_text("too short " * 10)
    assert hf_relpos_cli.main(argv + ["--train-file", str(short)]) == 2
    assert re.search("--train-file .*at least 1000", one_line_error(capsys, "train"))
    assert not (tmp_path / "m").exists() and not (tmp_path / "m-checkpoints").exists()


# ---------------------------------------------------------------------------
# 8. the console script
# ---------------------------------------------------------------------------


def test_console_script_help_lists_subcommands():
    script = Path(sys.executable).parent / "hf-relpos"
    assert script.is_file(), f"console script not installed next to {sys.executable}"
    result = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: hf-relpos")
    for name in SUBCOMMANDS:
        assert re.search(rf"^\s+{re.escape(name)}\s", result.stdout, re.M), f"{name} missing from --help"
