"""The stdlib corpus (``--corpus stdlib``): Python's standard library source split by module, tests and
site-packages excluded; the command line's --corpus; and compare's re-evaluation of finished runs (--sliding).

The end-to-end tests train on a small corpus of real standard-library files (``small_stdlib``) rather than the
whole 12 MB, whose tokenizer alone takes about 15 s and 2.7 GB.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import zlib
from pathlib import Path

import pytest

import hf_relpos.commands.compare
import hf_relpos_cli
from hf_relpos import data
from hf_relpos.commands.common import RUN_FILE
from hf_relpos.commands.errors import UserError
from hf_relpos.commands.train import TrainOptions, train_model

# One pytest-xdist worker runs this whole module (make test: --dist loadgroup): its shared fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_corpus")

TINY = ["--steps", "2", "--seq-len", "16", "--batch-size", "2", "--vocab-size", "300", "--eval-tokens", "64"]


def run(argv, capsys):
    code = hf_relpos_cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(code, err, command):
    assert code == 2, err
    assert err.startswith(f"hf-relpos {command}: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _write(root: Path, relative: str, text: str = "x = 1\n") -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_stdlib_files_leave_out_tests_and_site_packages(tmp_path):
    kept = ["os.py", "json/__init__.py", "json/decoder.py", "email/mime/text.py", "contest.py", "pytest_like/a.py"]
    left_out = ["test/test_os.py", "test/support/__init__.py", "lib2to3/tests/data/x.py", "idlelib/idle_test/t.py",
                "ctypes/test/test_x.py", "unittest/testmock/m.py", "site-packages/pkg/m.py", "dist-packages/m.py",
                "json/__pycache__/decoder.py", "notes.txt"]
    for relative in kept + left_out:
        _write(tmp_path, relative)
    assert data.stdlib_files(tmp_path) == sorted(kept)
    # the running Python's: its modules are there, its tests and installed packages are not
    real = data.stdlib_files()
    assert {"os.py", "json/decoder.py", "asyncio/events.py"} <= set(real) and len(real) > 500
    for path in real:
        parts = path.split("/")[:-1]
        assert not any(p in ("test", "tests", "idle_test", "site-packages", "dist-packages") or p.startswith("test")
                       for p in parts), path


def test_split_by_module_whole_files_in_one_split_whatever_the_walk_order(tmp_path, monkeypatch):
    files = [f"pkg{i % 5}/mod{i}.py" for i in range(60)]
    for relative in files:
        _write(tmp_path, relative, f"# module {relative}\n" + "def f():\n    return 1\n" * 3)
    (tmp_path / "pkg0" / "latin1.py").write_bytes(b"# caf\xe9\n")  # not UTF-8: skipped and counted
    splits, description = data.stdlib_corpus(tmp_path)
    for relative in files:
        bucket = zlib.crc32(relative.encode()) % 100
        expected = "train" if bucket < 90 else "validation" if bucket < 95 else "test"
        assert data.stdlib_split(relative) == expected
        holders = [part for part, text in splits.items() if f"# module {relative}\n" in text]
        assert holders == [expected], relative  # whole, and in its own split only
    assert all(splits[part] for part in splits), {p: len(t) for p, t in splits.items()}  # 60 files reach all three
    assert f"Python {platform.python_version()} " in description and "1 not UTF-8, skipped" in description
    assert "caf" not in "".join(splits.values())

    walk = os.walk  # another file-system order gives the same corpus

    def reversed_walk(top):
        for folder, dirs, names in walk(top):
            dirs.reverse()
            yield folder, dirs, names[::-1]

    monkeypatch.setattr(data.os, "walk", reversed_walk)
    assert data.stdlib_corpus(tmp_path) == (splits, description)


def test_the_real_stdlib_corpus_is_split_90_5_5_and_names_the_python_version():
    splits, description = data.corpus("stdlib")
    assert f"Python {platform.python_version()} standard library" in description
    sizes = {part: len(text) for part, text in splits.items()}
    total = sum(sizes.values())
    assert total > 2_000_000  # about 12 MB on CPython 3.11
    assert 0.8 < sizes["train"] / total < 0.97 and sizes["validation"] > 50_000 and sizes["test"] > 50_000, sizes
    assert data.corpus("docs")[0] == data.embedded_corpus()  # the default corpus is the docs, as before
    assert hf_relpos_cli.CORPORA == data.CORPORA  # restated by the torch-free parser


def test_tokenizing_in_pieces_gives_the_tokens_of_the_whole_text():
    """data.tokenized trains and encodes the corpus in pieces (its peak memory a third of the whole text's): the
    same tokenizer and the same tokens, here with pieces of 2 KB or more (14 cuts) in code and in prose."""
    text = data.corpus("stdlib")[0]["test"][:60000] + "\n\n" + data.embedded_corpus()["validation"]
    pieces = data._pieces(text, 2048)
    assert "".join(pieces) == text and len(pieces) > 10
    whole = data.train_tokenizer([text], vocab_size=400)
    assert data.train_tokenizer(pieces, vocab_size=400).backend_tokenizer.to_str() == whole.backend_tokenizer.to_str()
    joined = [token for piece in pieces for token in data.encode(whole, piece).tolist()]
    assert joined == data.encode(whole, text).tolist()


@pytest.mark.parametrize("argv", [
    ["train", "--corpus", "stdlib", "--train-file", "a.txt"],
    ["compare", "--train-file", "a.txt", "--corpus", "docs"],
    ["eval", "folder", "--corpus", "stdlib", "--eval-file", "a.txt"],
])
def test_corpus_with_own_text_is_one_line(argv, capsys):
    with pytest.raises(SystemExit) as info:  # refused by the parser, before torch is imported
        hf_relpos_cli.main(argv)
    err = one_line_error(info.value.code, capsys.readouterr().err, argv[0])
    assert "--corpus" in err and ("--train-file" in err or "--eval-file" in err), err


def test_corpus_with_own_text_is_refused_through_the_api_too(tmp_path):
    with pytest.raises(UserError, match="--corpus stdlib and --train-file"):
        train_model(TrainOptions(output_dir=str(tmp_path / "m"), corpus="stdlib", train_file=["a.txt"]))
    assert not (tmp_path / "m").exists()


@pytest.fixture(scope="module")
def small_stdlib(tmp_path_factory):
    """A standard library of 40 real modules (each split has some): ``data.stdlib_root`` points there while a
    test runs, and the per-process caches are emptied before and after."""
    root = tmp_path_factory.mktemp("stdlib")
    real = data.stdlib_root()
    chosen = {"train": [], "validation": [], "test": []}
    for path in data.stdlib_files():
        part = data.stdlib_split(path)
        if len(chosen[part]) < {"train": 34, "validation": 3, "test": 3}[part] and (real / path).stat().st_size > 4000:
            chosen[part].append(path)
    for path in sum(chosen.values(), []):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(real / path, root / path)
    return root


@pytest.fixture
def on_small_stdlib(small_stdlib, monkeypatch):
    monkeypatch.setattr(data, "stdlib_root", lambda: small_stdlib)
    data.corpus.cache_clear()
    data.tokenized.cache_clear()
    yield small_stdlib
    data.corpus.cache_clear()
    data.tokenized.cache_clear()


def test_train_on_stdlib_and_eval_defaults_to_its_corpus(on_small_stdlib, tmp_path, capsys):
    out = tmp_path / "model"
    assert run(["train", "--corpus", "stdlib", "--output-dir", str(out), *TINY, "--quiet"], capsys)[0] == 0
    record = json.loads((out / RUN_FILE).read_text())
    assert record["corpus_name"] == "stdlib" and record["python"] == platform.python_version()
    assert "40 .py files" in record["corpus"] and "standard library" in (out / "README.md").read_text()
    expected = data.tokenized("stdlib", 300)[1]
    assert record["train_tokens"] == expected["train"].numel()

    def ppl(*flags):
        code, printed, err = run(["eval", str(out), "--factors", "1", "--eval-tokens", "64", *flags], capsys)
        assert code == 0, err
        return float(printed.split(":")[1])

    # no flag: the record's corpus (the perplexity training recorded); the docs are other text
    assert ppl() == pytest.approx(record["test_ppl"], abs=0.006) == ppl("--corpus", "stdlib")
    assert ppl("--corpus", "docs") != pytest.approx(record["test_ppl"], rel=1e-3)


def test_compare_tokenizes_once_and_reevaluates_sliding_without_training(on_small_stdlib, tmp_path, monkeypatch,
                                                                         capsys):
    from hf_relpos.commands.common import load_folder
    from hf_relpos.commands.train import evaluate_lengths

    calls = []
    train_tokenizer = data.train_tokenizer
    monkeypatch.setattr(data, "train_tokenizer", lambda *a, **k: calls.append(1) or train_tokenizer(*a, **k))
    out = tmp_path / "cmp"
    base = ["compare", "--corpus", "stdlib", "--quick", "--schemes", "alibi", "rope", "--seeds", "1",
            "--factors", "1", "2", "--output-dir", str(out), "--quiet", *TINY]
    assert run(base, capsys)[0] == 0
    assert len(calls) == 1  # two runs, one tokenizer
    table = (out / "compare.md").read_text()
    records = {p: p.read_text() for p in out.glob(f"models/*/seed-0/{RUN_FILE}")}
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if RUN_FILE not in p.name)

    def no_training(options):
        raise AssertionError(f"{options.output_dir} was trained again")

    monkeypatch.setattr(hf_relpos.commands.compare, "train_model", no_training)
    assert run(base + ["--sliding", "--resume"], capsys)[0] == 0
    assert (out / "compare.md").read_text() == table  # the segments' table stays, the sliding one is beside it
    new = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if RUN_FILE not in p.name)
    assert set(new) - set(files) == {"cmp/compare-sliding.md", "cmp/compare-sliding.json", "cmp/compare-sliding.png"}
    rows = {row["scheme"]: row for row in json.loads((out / "compare-sliding.json").read_text())["rows"]}
    stream = data.encode(data.tokenized("stdlib", 300)[0], data.corpus("stdlib")[0]["test"])
    for path, before in records.items():
        record, old = json.loads(path.read_text()), json.loads(before)
        assert {k: v for k, v in record.items() if k != "evaluations"} == old  # the training's evaluation kept
        model, _ = load_folder(str(path.parent))
        direct = evaluate_lengths(model, stream, [16, 32], 64, stride=16)
        sliding = record["evaluations"]["sliding windows, stride 16"]["test_ppl_by_length"]
        assert sliding == {str(n): p for n, p in direct.items()}
        assert direct[32] != old["test_ppl_by_length"]["32"]  # another evaluation indeed
        assert rows[path.parent.parent.name]["ppl_2x_seeds"] == [direct[32]]


def test_resume_on_another_corpus_is_one_line(tmp_path, capsys):
    """A checkpoint records its corpus: resuming it with another --corpus is refused, also for a checkpoint of
    before --corpus (recorded without it: the docs)."""
    from hf_relpos.commands.common import TIME_FILE

    out = tmp_path / "model"
    assert run(["train", "--output-dir", str(out), *TINY, "--quiet"], capsys)[0] == 0
    records = list((tmp_path / "model-checkpoints").glob(f"checkpoint-*/{TIME_FILE}"))
    assert records and all(json.loads(r.read_text())["options"]["corpus"] == "docs" for r in records)
    for older in (False, True):
        if older:
            for record in records:
                saved = json.loads(record.read_text())
                del saved["options"]["corpus"]
                record.write_text(json.dumps(saved))
        code, _, err = run(["train", "--output-dir", str(out), "--corpus", "stdlib", "--resume", "--quiet"], capsys)
        err = one_line_error(code, err, "train")
        assert "--corpus 'docs'" in err and "--corpus 'stdlib'" in err, err
