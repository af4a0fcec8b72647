"""``hf-relpos inspect``: the figures of what a trained folder learned about position.

The figures' data are checked, not only the files: ``matplotlib.pyplot.close`` is wrapped to keep each
figure, and the plotted curves and images are compared with values computed here from the model's own
parameters (ALiBi's slopes, T5's table at its causal buckets, Shaw's and Transformer-XL's position terms,
which must reproduce the model's attention probabilities) and with the model's ``output_attentions``.

Tiny models, trained in-process for 2 steps at L = 16 (a 300-token BPE): the file takes well under a
minute on two CPU cores.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

import hf_relpos_cli
from hf_relpos import RelPosForCausalLM, inspection
from hf_relpos.commands.common import RUN_FILE, load_folder, prepare_output
from hf_relpos.commands.errors import UserError
from hf_relpos.functional import alibi_slopes, fire_bias, t5_relative_position_bucket
from tiny import tiny_config

# One pytest-xdist worker runs this whole module (make test: --dist loadgroup): its shared fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_inspect")

torch.set_num_threads(1)

SEQ_LEN = 16
TINY = ["--steps", "2", "--seq-len", str(SEQ_LEN), "--batch-size", "4", "--vocab-size", "300", "--eval-tokens", "64",
        "--quiet"]  # fmt: skip
PROMPT = "The for statement"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(scheme)``: a folder written by ``hf-relpos train`` (trained once per module)."""
    folders = {}

    def get(scheme: str) -> Path:
        if scheme not in folders:
            folder = tmp_path_factory.mktemp(f"inspect-{scheme}") / scheme
            assert hf_relpos_cli.main(["train", "--position-encoding", scheme, "--output-dir", str(folder), *TINY]) == 0
            folders[scheme] = folder
        return folders[scheme]

    return get


@pytest.fixture
def figures(monkeypatch):
    """Every figure closed while the test runs, in order (still drawable: closing keeps the artists)."""
    import matplotlib.pyplot as plt

    kept = []
    close = plt.close

    def keep(fig=None):
        kept.append(fig)
        close(fig)

    monkeypatch.setattr(plt, "close", keep)
    return kept


def run(argv, capsys):
    code = hf_relpos_cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(code, err) -> str:
    assert code == 2, err
    assert err.startswith("hf-relpos inspect: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def suptitle(fig) -> str:
    return fig._suptitle.get_text() if fig._suptitle is not None else ""


def head_lines(ax) -> dict:
    """{head: (x, y)} of the lines labelled ``head h``."""
    lines = {}
    for line in ax.get_lines():
        label = line.get_label()
        if label.startswith("head "):
            lines[int(label.split()[1])] = (torch.tensor(line.get_xdata()), torch.tensor(line.get_ydata()))
    return lines


def visible_axes(fig) -> list:
    return [ax for ax in fig.axes if ax.get_visible() and ax.get_label() != "<colorbar>"]


def assert_png(path: Path) -> None:
    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_SIGNATURE, f"{path} is not a PNG file"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and min(image.size) >= 200, image.size


def prompt_ids(folder: Path, prompt: str = PROMPT) -> tuple:
    model, tokenizer = load_folder(str(folder))
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return model, tokenizer, ids


def capture_projections(model, ids) -> tuple:
    """Per layer: queries and keys ``[T, H, D]`` (hooks on q_proj / k_proj) and attention ``[H, T, T]``."""
    config = model.config
    qs, ks, hooks = {}, {}, []
    for index, layer in enumerate(model.model.layers):
        for module, store in ((layer.self_attn.q_proj, qs), (layer.self_attn.k_proj, ks)):
            hooks.append(module.register_forward_hook(
                lambda m, i, out, index=index, store=store: store.__setitem__(
                    index, out[0].reshape(out.shape[1], config.num_attention_heads, -1).detach())))
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True, use_cache=False)
    for hook in hooks:
        hook.remove()
    return qs, ks, [a[0] for a in out.attentions]


def causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    T = scores.shape[-1]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1)


# ---------------------------------------------------------------------------
# 1. position.png: the plotted curves are the model's position term
# ---------------------------------------------------------------------------


def test_alibi_curve_of_each_head_is_minus_its_slope_times_distance(trained, figures, tmp_path, capsys):
    folder = trained("alibi")
    out = tmp_path / "figs"
    code, stdout, err = run(["inspect", str(folder), "--prompt", PROMPT, "--output-dir", str(out)], capsys)
    assert code == 0, err
    for name in ("position.png", "attention-layer0.png", "attention-layer1.png"):
        assert_png(out / name)
    assert sorted(p.name for p in out.iterdir()) == ["attention-layer0.png", "attention-layer1.png", "position.png"]
    assert "alibi" in stdout and "position.png" in stdout

    position = figures[0]
    assert "alibi" in suptitle(position) and "position bias" in suptitle(position)
    (ax,) = visible_axes(position)
    lines = head_lines(ax)
    heads = json.loads((folder / "config.json").read_text())["num_attention_heads"]
    assert sorted(lines) == list(range(heads))
    slopes = alibi_slopes(heads, dtype=torch.float64)
    for h, (x, y) in lines.items():
        # default distance: twice the training length
        assert x.tolist() == list(range(2 * SEQ_LEN + 1))
        torch.testing.assert_close(y.double(), -slopes[h] * x.double(), atol=1e-5, rtol=1e-5)
    # the training length is marked
    marks = [line for line in ax.get_lines() if "training" in line.get_label()]
    assert len(marks) == 1 and float(marks[0].get_xdata()[0]) == SEQ_LEN - 1


def test_t5_curve_is_the_table_at_each_distances_causal_bucket(trained, figures, tmp_path, capsys):
    folder = trained("t5_bias")
    distance = 300  # past max_distance = 128: exact, log-spaced and saturated buckets
    code, _, err = run(["inspect", str(folder), "--prompt", PROMPT, "--output-dir", str(tmp_path / "f"),
                        "--distance", str(distance)], capsys)  # fmt: skip
    assert code == 0, err
    assert_png(tmp_path / "f" / "position.png")
    model, _, _ = prompt_ids(folder)
    config = model.config
    table = model.model.position.relative_attention_bias.weight.detach()  # [buckets, H]
    d = torch.arange(distance + 1)
    buckets = t5_relative_position_bucket(
        -d, bidirectional=False, num_buckets=config.relative_attention_num_buckets,
        max_distance=config.relative_attention_max_distance,
    )  # fmt: skip
    (ax,) = visible_axes(figures[0])
    lines = head_lines(ax)
    assert sorted(lines) == list(range(config.num_attention_heads))
    for h, (x, y) in lines.items():
        assert x.tolist() == d.tolist()
        torch.testing.assert_close(y.float(), table[buckets, h], atol=0, rtol=0)
    assert len({round(v, 6) for v in lines[0][1].tolist()}) > 3  # a real table, not a constant


def test_shaw_curves_are_the_mean_query_position_term_that_reproduces_attention(trained, figures, tmp_path, capsys):
    folder = trained("shaw")
    code, stdout, err = run(["inspect", str(folder), "--prompt", PROMPT, "--output-dir", str(tmp_path / "f")], capsys)
    assert code == 0, err
    assert "per layer" in stdout
    model, _, ids = prompt_ids(folder)
    config = model.config
    qs, ks, attentions = capture_projections(model, ids)
    k = config.max_relative_position
    T = ids.shape[1]
    axes = visible_axes(figures[0])
    assert len(axes) == config.num_hidden_layers
    distances = torch.arange(2 * SEQ_LEN + 1)
    for layer, ax in enumerate(axes):
        assert ax.get_title() == f"shaw, layer {layer}"
        attn = model.model.layers[layer].self_attn
        rel_k = attn.relative.rel_k.detach()
        q, key = qs[layer], ks[layer]  # [T, H, D]
        # The term, written from Shaw et al.: e_ij = (q_i·k_j + q_i·a^K[clip(j-i, -k, k) + k]) / sqrt(D).
        rel = (torch.arange(T)[None, :] - torch.arange(T)[:, None]).clamp(-k, k) + k  # [T(i), T(j)]
        position = torch.einsum("ihd,ijd->hij", q, rel_k[rel]) * attn.scaling
        content = torch.einsum("ihd,jhd->hij", q, key) * attn.scaling
        torch.testing.assert_close(causal_softmax(content + position), attentions[layer], atol=1e-5, rtol=1e-4)
        # The plotted curve: the same term for the prompt's mean query, over distances d = i - j.
        expected = torch.einsum("hd,nd->hn", q.mean(0), rel_k[(-distances).clamp(-k, k) + k]) * attn.scaling
        lines = head_lines(ax)
        assert sorted(lines) == list(range(config.num_attention_heads))
        for h, (x, y) in lines.items():
            assert x.tolist() == distances.tolist()
            torch.testing.assert_close(y.float(), expected[h], atol=1e-6, rtol=1e-5)


def test_transformer_xl_curves_are_the_mean_query_position_term_that_reproduces_attention(
    trained, figures, tmp_path, capsys
):
    folder = trained("transformer_xl")
    code, _, err = run(["inspect", str(folder), "--prompt", PROMPT, "--output-dir", str(tmp_path / "f"),
                        "--distance", "40"], capsys)  # fmt: skip
    assert code == 0, err
    model, _, ids = prompt_ids(folder)
    config = model.config
    qs, ks, attentions = capture_projections(model, ids)
    T = ids.shape[1]
    axes = visible_axes(figures[0])
    assert [ax.get_title() for ax in axes] == [f"transformer_xl, layer {n}" for n in range(config.num_hidden_layers)]
    for layer, ax in enumerate(axes):
        attn = model.model.layers[layer].self_attn
        relative = attn.relative
        u, v = relative.r_w_bias.detach(), relative.r_r_bias.detach()
        r = relative._project(torch.arange(41), torch.float32).detach()  # [H, 41, D]: W_{k,R} R_d, d = 0 .. 40
        q, key = qs[layer], ks[layer]
        # Dai et al.: e_ij = ((q_i + u)·k_j + (q_i + v)·W_{k,R} R_{i-j}) / sqrt(D).
        d = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).clamp(min=0)  # [T(i), T(j)]
        position = torch.einsum("ihd,hijd->hij", q + v, r[:, d]) * attn.scaling
        content = torch.einsum("ihd,jhd->hij", q + u, key) * attn.scaling
        torch.testing.assert_close(causal_softmax(content + position), attentions[layer], atol=1e-5, rtol=1e-4)
        expected = torch.einsum("hd,hnd->hn", q.mean(0) + v, r) * attn.scaling
        lines = head_lines(ax)
        assert sorted(lines) == list(range(config.num_attention_heads))
        for h, (x, y) in lines.items():
            assert x.tolist() == list(range(41))
            torch.testing.assert_close(y.float(), expected[h], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scheme", ["log_decay", "kerple_log", "fire", "alibi", "t5_bias"])
def test_every_additive_bias_scheme_goes_through_the_one_seam(scheme):
    """No training: a random model; the curves equal the functional formulas with its parameters."""
    torch.manual_seed(0)
    model = RelPosForCausalLM(tiny_config(scheme, vocab_size=50, num_attention_heads=4)).eval()
    n = 40
    curves = inspection.position_curves(model, n)
    assert not curves.per_layer and tuple(curves.values.shape) == (1, 4, n + 1)
    d = torch.arange(n + 1, dtype=torch.float32)
    position = model.model.position
    if scheme == "log_decay":
        expected = (-model.config.log_decay_scale * torch.log1p(d)).expand(4, -1)
    elif scheme == "kerple_log":
        r1, r2 = position.r1.detach().clamp_min(position.floor), position.r2.detach().clamp_min(position.floor)
        expected = -r1[:, None] * torch.log1p(r2[:, None] * d)
    elif scheme == "alibi":
        expected = -alibi_slopes(4)[:, None] * d
    elif scheme == "t5_bias":
        buckets = t5_relative_position_bucket(-d.long(), False, model.config.relative_attention_num_buckets,
                                              model.config.relative_attention_max_distance)  # fmt: skip
        expected = position.relative_attention_bias.weight.detach()[buckets].T
    else:  # fire: the bias of the query at position n (FIRE's depends on it), key n - d at distance d
        first, last = position.mlp[0], position.mlp[2]
        full = fire_bias(first.weight, first.bias, last.weight, last.bias, position.c,
                         (position.threshold_scale * position.init_threshold).abs(), n + 1, n + 1).detach()
        expected = full[0, :, n].flip(-1)
    torch.testing.assert_close(curves.values[0], expected, atol=1e-5, rtol=1e-5)
    assert curves.values[0].std() > 0  # a curve that varies


def test_a_t5_table_per_layer_gives_one_curve_per_layer():
    """relative_attention_per_layer: each layer's curves are its own table at each distance's causal bucket (the
    inspection read a shared table, which such a model has not), and the figure has a panel per layer."""
    torch.manual_seed(0)
    config = tiny_config("t5_bias", vocab_size=50, num_attention_heads=4, relative_attention_per_layer=True,
                         num_hidden_layers=3)
    model = RelPosForCausalLM(config).eval()
    n = 40
    curves = inspection.position_curves(model, n)
    assert curves.per_layer and tuple(curves.values.shape) == (3, 4, n + 1) and "a table per layer" in curves.title
    buckets = t5_relative_position_bucket(-torch.arange(n + 1), False, config.relative_attention_num_buckets,
                                          config.relative_attention_max_distance)
    for layer, table in enumerate(model.model.position.layers):
        torch.testing.assert_close(curves.values[layer], table.relative_attention_bias.weight.detach()[buckets].T)
    assert not torch.equal(curves.values[0], curves.values[1])


# ---------------------------------------------------------------------------
# 2. attention-layer{L}.png: the images are the model's attention probabilities
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["rope", "alibi"])
def test_attention_maps_are_the_models_output_attentions(scheme, trained, figures, tmp_path, capsys):
    folder = trained(scheme)
    out = tmp_path / "f"
    code, stdout, err = run(["inspect", str(folder), "--prompt", PROMPT, "--output-dir", str(out)], capsys)
    assert code == 0, err
    model, tokenizer, ids = prompt_ids(folder)
    config = model.config
    with torch.no_grad():
        attentions = model(input_ids=ids, output_attentions=True, use_cache=False).attentions
    maps = [fig for fig in figures if "attention probabilities" in suptitle(fig)]
    assert len(maps) == config.num_hidden_layers
    tokens = [tokenizer.decode([t]) for t in ids[0].tolist()]
    assert 1 < len(tokens) <= 32
    for layer, fig in enumerate(maps):
        assert_png(out / f"attention-layer{layer}.png")
        assert suptitle(fig).startswith(f"{scheme}, layer {layer}:")
        axes = visible_axes(fig)
        assert len(axes) == config.num_attention_heads
        for h, ax in enumerate(axes):
            assert ax.get_title() == f"{scheme}, layer {layer}, head {h}"
            (image,) = ax.get_images()
            torch.testing.assert_close(torch.tensor(image.get_array().data), attentions[layer][0, h], atol=0, rtol=0)
            assert [t.get_text() for t in ax.get_xticklabels()] == tokens
            assert [t.get_text() for t in ax.get_yticklabels()] == tokens
    if scheme == "rope":
        assert not (out / "position.png").exists()
        assert "rope: no position term in attention (rotary" in stdout and "attention maps only" in stdout
        assert len(figures) == config.num_hidden_layers
    else:
        assert (out / "position.png").is_file()


def test_long_prompt_keeps_index_ticks(trained, figures, tmp_path, capsys):
    folder = trained("alibi")
    prompt = "The while statement is used for repeated execution as long as an expression is true. " * 2
    code, _, err = run(["inspect", str(folder), "--prompt", prompt, "--output-dir", str(tmp_path / "f")], capsys)
    assert code == 0, err
    _, tokenizer, ids = prompt_ids(folder, prompt)
    assert ids.shape[1] > 32
    fig = next(f for f in figures if "attention probabilities" in suptitle(f))
    ax = visible_axes(fig)[0]
    assert ax.get_images()[0].get_array().shape == (ids.shape[1], ids.shape[1])
    texts = {t.get_text() for t in ax.get_xticklabels()}
    assert not texts & {tokenizer.decode([t]) for t in ids[0].tolist()} - {""}, texts


@pytest.mark.parametrize("heads", [4, 16])
def test_grids_are_readable_for_many_heads(heads, figures, tmp_path):
    torch.manual_seed(0)
    weights = torch.rand(heads, 5, 5).softmax(-1)
    inspection.plot_attention(weights, tmp_path / "a.png", scheme="alibi", layer=3, labels=list("abcde"))
    axes = visible_axes(figures[-1])
    side = math.ceil(math.sqrt(heads))
    assert len(axes) == heads and len(figures[-1].axes) >= side * ((heads + side - 1) // side)
    assert [ax.get_title() for ax in axes] == [f"alibi, layer 3, head {h}" for h in range(heads)]
    curves = inspection.PositionCurves(
        scheme="alibi", distances=torch.arange(9), values=torch.randn(1, heads, 9), per_layer=False,
        ylabel="bias", title="t",
    )  # fmt: skip
    inspection.plot_position(curves, tmp_path / "p.png", train_length=4)
    legend = figures[-1].legends[0]
    assert [t.get_text() for t in legend.get_texts()][:heads] == [f"head {h}" for h in range(heads)]
    colors = {tuple(line.get_color()) for line in visible_axes(figures[-1])[0].get_lines()[:heads]}
    assert len(colors) == heads  # every head its own colour
    assert_png(tmp_path / "a.png")
    assert_png(tmp_path / "p.png")


# ---------------------------------------------------------------------------
# 3. errors and the overwrite guard
# ---------------------------------------------------------------------------


def test_default_output_dir_and_overwrite_guard(trained, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(trained("alibi"), folder)
    code, stdout, err = run(["inspect", str(folder), "--prompt", PROMPT], capsys)
    assert code == 0, err
    out = folder / "inspect"
    assert str(out) in stdout
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"position.png", "attention-layer0.png", "attention-layer1.png"}

    code, _, err = run(["inspect", str(folder), "--prompt", "A different prompt"], capsys)
    err = one_line_error(code, err)
    assert "--overwrite" in err and "position.png" in err and str(out) in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing replaced

    code, _, err = run(["inspect", str(folder), "--prompt", "A different prompt", "--overwrite"], capsys)
    assert code == 0, err
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(after) == set(before) and after["attention-layer0.png"] != before["attention-layer0.png"]

    # the model folder with its inspect/ figures is still one that train --overwrite / --resume accepts
    assert prepare_output(folder, overwrite=True, resume=None) is None
    with pytest.raises(UserError, match="already holds a trained model"):
        prepare_output(folder, overwrite=False, resume=None)


def test_user_errors_are_one_line(trained, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    err = one_line_error(*run(["inspect", str(missing)], capsys)[::2])
    assert str(missing) in err and "does not exist" in err

    empty = tmp_path / "empty"
    empty.mkdir()
    err = one_line_error(*run(["inspect", str(empty)], capsys)[::2])
    assert str(empty) in err and "hf-relpos train" in err

    other = tmp_path / "bert"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert"}))
    err = one_line_error(*run(["inspect", str(other)], capsys)[::2])
    assert "'bert'" in err and "relpos" in err

    folder = trained("alibi")
    new = tmp_path / "new-out"
    for prompt in ("", "   \n"):
        err = one_line_error(*run(["inspect", str(folder), "--prompt", prompt, "--output-dir", str(new)], capsys)[::2])
        assert "--prompt" in err and repr(prompt) in err
    assert not new.exists()  # a refused command creates nothing

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    err = one_line_error(*run(["inspect", str(folder), "--output-dir", str(a_file)], capsys)[::2])
    assert "--output-dir" in err and "is a file" in err

    with pytest.raises(SystemExit) as exit_:
        hf_relpos_cli.main(["inspect", str(folder), "--distance", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("hf-relpos inspect: error: argument --distance") and err.count("\n") == 1

    # a model folder without the training record: the default distance is unknown
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare, ignore=shutil.ignore_patterns(RUN_FILE, "inspect"))
    err = one_line_error(*run(["inspect", str(bare), "--output-dir", str(tmp_path / "b")], capsys)[::2])
    assert "--distance" in err and RUN_FILE in err
    assert not (tmp_path / "b").exists()
    code, _, err = run(["inspect", str(bare), "--output-dir", str(tmp_path / "b"), "--distance", "20"], capsys)
    assert code == 0, err


def test_parser_lists_inspect_with_its_options():
    root = hf_relpos_cli.parser()
    assert "inspect" in root.format_help()
    sub = next(a for a in root._actions if a.dest == "command").choices["inspect"]
    text = sub.format_help()
    for flag in ("--prompt", "--output-dir", "--distance", "--overwrite", "FOLDER/inspect"):
        assert flag in text, text
    assert "inspect" in (hf_relpos_cli.__doc__ or "")
