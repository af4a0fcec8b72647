"""The import graph of hf_relpos and hf_relpos_cli (scripts/import_graph.py) has no cycle, function-level imports and
the command line's dispatch by name included; and the script does find a cycle where there is one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import import_graph  # noqa: E402


def test_the_package_has_no_import_cycle():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "import_graph.py")], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "cycles: none", result.stdout
    edges = import_graph.graph()
    assert "hf_relpos.commands.train" in edges["hf_relpos_cli"]  # dispatch by "module:function" is an edge
    assert not [m for m, targets in edges.items() if m.startswith("hf_relpos.commands") and "hf_relpos_cli" in targets]


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    (tmp_path / "hf_relpos").mkdir()
    (tmp_path / "hf_relpos" / "__init__.py").write_text("from .a import f\n")
    (tmp_path / "hf_relpos" / "a.py").write_text("def f():\n    from hf_relpos_cli import UserError\n")
    (tmp_path / "hf_relpos" / "b.py").write_text("from . import a\n")
    (tmp_path / "hf_relpos_cli.py").write_text("class UserError(Exception): ...\n\ndef main():\n    from hf_relpos import a\n")
    edges = import_graph.graph(tmp_path)
    assert edges["hf_relpos.b"] == ["hf_relpos.a"]  # `from . import a`: the module, not its package
    assert import_graph.cycles(edges) == [["hf_relpos.a", "hf_relpos_cli"]]
    (tmp_path / "hf_relpos" / "a.py").write_text("def f():\n    pass\n")
    assert import_graph.cycles(import_graph.graph(tmp_path)) == []
