"""Every code block of the README and of the guides under docs/ runs as written.

Fences, by language:

- ``python``: the page's Python blocks run in order in one fresh interpreter (this test's ``sys.executable``),
  sharing their names, in a temporary working directory of the page's own;
- ``bash``/``console``: run at their place in the same directory by ``bash -e``; a ``console`` block runs its
  ``$ `` lines (the rest is sample output). ``hf-relpos`` and ``python`` are the ones beside ``sys.executable``;
- ``text``: output or illustration, never run.

A code block that cannot run here (an install, a GPU launch, the Makefile's own jobs) is preceded by the line
``<!-- docs-test: skip (reason) -->``; each shows up as one skipped test with its reason. Any other fence (no
language, another language) is an error, so nothing escapes by accident. Under ``make compat``
(``HF_RELPOS_TEST_INSTALLED=1``) the pages are read from the checkout and run against the installed wheel.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN = {"python": "python", "bash": "shell", "console": "console"}
NOT_CODE = {"text"}
SKIP = re.compile(r"^\s*<!-- docs-test: skip \((?P<reason>[^)]+)\) -->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[^\s`]*)\s*$")
PAGE_TIMEOUT_S = 600


def blocks(path: Path):
    """(language, first line of the code (1-based), code, skip reason or None) for every fenced block of a page."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, lang = opening["indent"], opening["fence"], opening["lang"]
        end = i + 1
        while end < len(lines) and not (lines[end].strip().startswith(fence[0] * len(fence))
                                        and lines[end].strip().strip(fence[0]) == ""):
            end += 1
        if end == len(lines):
            raise AssertionError(f"{path.name}:{i + 1}: unclosed fence")
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip = SKIP.match(previous)
        found.append((lang, i + 2, "\n".join(body) + "\n", skip["reason"] if skip else None))
        i = end + 1
    return found


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _runnable_pages():
    return [path for path in PAGES if any(lang in RUN and skip is None for lang, _, _, skip in blocks(path))]


def _skipped_blocks():
    return [(path, line, lang, skip) for path in PAGES for lang, line, _, skip in blocks(path) if skip is not None]


# Run by a fresh interpreter per page: Python blocks share one namespace; shell blocks run at their place.
DRIVER = textwrap.dedent("""
    import json, os, subprocess, sys
    steps = json.load(open(sys.argv[1], encoding="utf-8"))
    namespace = {"__name__": "__main__"}
    if os.environ.get("HF_RELPOS_TEST_INSTALLED"):  # make compat: the pages must see the installed wheel
        import hf_relpos
        # The checkout's own package, not any path below the checkout: make compat's venvs live inside it.
        if os.path.dirname(os.path.abspath(hf_relpos.__file__)) == os.path.join(os.environ["HF_RELPOS_DOCS_CHECKOUT"], "hf_relpos"):
            sys.exit(f"HF_RELPOS_TEST_INSTALLED is set but the pages import the checkout: {hf_relpos.__file__}")
    for kind, page, line, code in steps:
        print(f"--- {page}:{line} ({kind})", flush=True)
        if kind == "python":
            exec(compile("\\n" * (line - 1) + code, page, "exec"), namespace)
            continue
        if kind == "console":
            code = "\\n".join(text[2:] for text in code.splitlines() if text.startswith("$ ")) + "\\n"
        done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code])
        if done.returncode != 0:
            sys.exit(f"{page}:{line}: the {kind} block exited {done.returncode}")
""")


def test_every_fence_is_run_or_marked():
    """Each block is Python, shell or console (run), or text (not code); skip markers say why and sit on code."""
    for path in PAGES:
        for lang, line, _, skip in blocks(path):
            where = f"{_relative(path)}:{line - 1}"
            assert lang in RUN or lang in NOT_CODE, (
                f"{where}: a ```{lang} block; use python, bash, console (run) or text (not run)")
            assert not (skip and lang in NOT_CODE), f"{where}: a skip marker on a text block"
    assert _runnable_pages(), "no runnable code block found"


@pytest.mark.parametrize("path, line, lang, reason", _skipped_blocks(),
                         ids=[f"{_relative(p)}:{n - 1}" for p, n, _, _ in _skipped_blocks()])
def test_skipped_block(path, line, lang, reason):
    """One skipped test per marked block, with the marker's reason (listed by ``pytest -ra``)."""
    pytest.skip(f"{_relative(path)}:{line - 1} ```{lang}: {reason}")


@pytest.mark.parametrize("path", _runnable_pages(), ids=_relative)
def test_page_runs_as_written(path):
    steps = [(RUN[lang], _relative(path), line, code)
             for lang, line, code, skip in blocks(path) if lang in RUN and skip is None]
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""), MPLBACKEND="Agg",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_RELPOS_DOCS_CHECKOUT=str(ROOT))
    env.pop("PYTHONPATH", None)  # the page sees hf_relpos as a user does: the installed one
    with tempfile.TemporaryDirectory(prefix="hf-relpos-docs-") as work:
        Path(work, "steps.json").write_text(json.dumps(steps), encoding="utf-8")
        Path(work, "driver.py").write_text(DRIVER, encoding="utf-8")
        done = subprocess.run([sys.executable, "driver.py", "steps.json"], cwd=work, env=env,
                              capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)
    assert done.returncode == 0, (
        f"{_relative(path)}: a block failed\n--- stdout\n{done.stdout[-6000:]}\n--- stderr\n{done.stderr[-6000:]}")
