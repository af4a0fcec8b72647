"""Count the assertions in the test suite (issue 22: no assertion is dropped when tests move).

An assertion is an ``assert`` statement, a call of a function or method whose name starts with ``assert``
(``torch.testing.assert_close``, ``self.assertEqual``, helpers named ``assert_*``) or a ``pytest.raises`` /
``pytest.warns`` / ``pytest.fail`` call, or a ``raise AssertionError``. Usage: ``python scripts/count_assertions.py [tests]``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

EXPECTATIONS = {"raises", "warns", "fail", "deprecated_call"}


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def count(source: str) -> int:
    n = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assert):
            n += 1
        elif isinstance(node, ast.Raise) and node.exc is not None and "AssertionError" in ast.unparse(node.exc):
            n += 1
        elif isinstance(node, ast.Call):
            name = _name(node.func)
            if name.startswith("assert") or name in EXPECTATIONS:
                n += 1
    return n


def main(argv: list) -> int:
    root = Path(argv[1] if len(argv) > 1 else "tests")
    total = 0
    for path in sorted(root.rglob("*.py")):
        n = count(path.read_text())
        total += n
        print(f"{n:6d}  {path}")
    print(f"{total:6d}  total")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
