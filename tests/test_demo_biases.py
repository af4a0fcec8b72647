"""scripts/demo_biases.py reproduces the published worked example in ../shared/worked-example.md.

The expected numbers are read from the published markdown, not copied here, so the test checks the
script against the source rather than against a transcription of it.
"""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

# One pytest-xdist worker runs this whole module (make test: --dist loadgroup): its shared fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_demo_biases")

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT.parent / "shared" / "worked-example.md"
# The published tables are rounded to 4 decimals; the tiny slack absorbs float noise at a rounding tie.
TOLERANCE = 5e-5 + 1e-12


def load_script():
    """Import scripts/demo_biases.py; scripts/ is not a package."""
    spec = importlib.util.spec_from_file_location("demo_biases", ROOT / "scripts" / "demo_biases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_tables(text):
    """Each markdown table as {caption: (column labels, [(row label, [floats])])}.

    The caption is the last non-blank line above the table (the header cell for the score table).
    """
    tables, lines = {}, text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            i += 1
            continue
        block = []
        while i < len(lines) and lines[i].startswith("|"):
            block.append([cell.strip() for cell in lines[i].strip().strip("|").split("|")])
            i += 1
        start = i - len(block)
        caption = next((line for line in reversed(lines[:start]) if line.strip()), "")
        header, rows = block[0], block[2:]  # block[1] is the |---| separator
        tables[header[0] or caption] = (header[1:], [(row[0], [float(c) for c in row[1:]]) for row in rows])
    return tables


@pytest.fixture(scope="module")
def published():
    if not PUBLISHED.is_file():
        pytest.skip(f"published worked example not found at {PUBLISHED} (CI has ../shared beside the checkout)")
    text = PUBLISHED.read_text(encoding="utf-8")
    tables = parse_tables(text)

    def table(key):
        (found,) = [caption for caption in tables if key in caption]
        return tables[found]

    bias_line = re.search(r"^Bias values:(.*)$", text, re.MULTILINE).group(1)
    bias = {int(d): float(b) for d, b in re.findall(r"(\d+):\s*(-?\d+\.\d+)", bias_line)}
    return {
        "scores": table("Q·K"),
        "bias": bias,
        "weights_without_bias": table("without bias"),
        "weights_with_bias": table("with the bias"),
    }


@pytest.fixture(scope="module")
def script():
    return load_script()


def test_script_input_is_the_published_score_table(published, script):
    columns, rows = published["scores"]
    assert tuple(columns) == script.EXAMPLE_TOKENS
    assert tuple(label for label, _ in rows) == script.EXAMPLE_TOKENS
    assert [tuple(values) for _, values in rows] == [tuple(r) for r in script.EXAMPLE_SCORES]


def test_bias_values_match_published(published, script):
    bias = script.worked_example()["bias_by_distance"]
    assert bias.dtype == torch.float64
    assert sorted(published["bias"]) == list(range(len(bias)))
    for distance, expected in published["bias"].items():
        assert abs(bias[distance].item() - expected) <= TOLERANCE, (distance, bias[distance].item(), expected)


@pytest.mark.parametrize("key", ["weights_without_bias", "weights_with_bias"])
def test_weights_match_published_table(published, script, key):
    weights = script.worked_example()[key]
    columns, rows = published[key]
    assert weights.dtype == torch.float64
    assert weights.shape == (len(rows), len(columns)) == (5, 5)
    for i, (label, expected_row) in enumerate(rows):
        for j, expected in enumerate(expected_row):
            got = weights[i, j].item()
            assert abs(got - expected) <= TOLERANCE, (key, label, columns[j], got, expected)


def test_main_prints_the_published_tables(published, script, capsys):
    try:
        script.main()
    finally:
        torch.set_printoptions(profile="default")  # main() sets print options for the whole process
    out = capsys.readouterr().out
    _, after = out.split("== Worked example", 1)
    heading, *lines = after.splitlines()
    assert "worked-example.md" in heading
    (bias_line,) = [line for line in lines if line.startswith("bias by distance:")]
    printed_bias = {int(d): float(b) for d, b in re.findall(r"(\d+):\s*(-?\d+\.\d+)", bias_line)}
    assert printed_bias == published["bias"]
    # After the heading, the rows labelled with a token are the without-bias table, then the with-bias one.
    rows = [line.split() for line in lines]
    printed = [row for row in rows if len(row) == 6 and row[0] in script.EXAMPLE_TOKENS]
    expected = published["weights_without_bias"][1] + published["weights_with_bias"][1]
    assert [row[0] for row in printed] == [label for label, _ in expected]
    # Printed to 4 decimals, as published: the same numbers exactly (the with-bias "mat" row is the last).
    assert [[float(x) for x in row[1:]] for row in printed] == [values for _, values in expected]
    assert printed[-1][0] == "mat"
