"""The project's import graph: which of its modules import which (function-level imports included), and its cycles.

    python scripts/import_graph.py            # the graph of hf_relpos and hf_relpos_cli, then "cycles: none"
    python scripts/import_graph.py --quiet    # the cycles only

Read with ``ast`` (nothing is imported). An edge is what an import statement names: ``import a.b`` and
``from a.b import c`` give ``a.b`` (or ``a.b.c`` when that is a module); imports inside functions count. The
parent packages that Python initialises before a submodule are not edges (a package's ``__init__`` importing its
own submodules is not a cycle; one of them importing the package back is, and is an edge). A string
``"package.module:function"`` naming a project module is an edge too: ``hf_relpos_cli`` dispatches its commands by
such names, imported after parsing. Exit status 1 when there is a cycle.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hf_relpos",)
MODULES = ("hf_relpos_cli",)
# Non-Python folders the project maps into the package (pyproject.toml's package-dir).
MAPPED = {"hf_relpos.model_cards": "model_cards"}
DISPATCH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # "module:function", as in hf_relpos_cli.COMMANDS


def project_modules(root: Path = ROOT) -> dict:
    """``{dotted name: path}`` of every module of the project."""
    modules = {name: root / f"{name}.py" for name in MODULES if (root / f"{name}.py").is_file()}
    folders = [(package, root / package) for package in PACKAGES] + [(n, root / f) for n, f in MAPPED.items()]
    for package, folder in folders:
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _resolve(name: str, modules: dict) -> str | None:
    """The project module ``name`` refers to: itself, or its longest prefix that is a module (``pkg.mod.attr``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: dict) -> set:
    """The project modules ``module`` imports, at any depth of its code (a function's imports too)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            # each name: the submodule it is, else an attribute of ``prefix`` (_resolve drops the attribute)
            names = [f"{prefix}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DISPATCH.fullmatch(node.value):
            names = [node.value.partition(":")[0]] if node.value.partition(":")[0] in modules else []
        for name in names:
            target = _resolve(name, modules)
            if target and target != module:
                found.add(target)
    return found


def graph(root: Path = ROOT) -> dict:
    modules = project_modules(root)
    return {module: sorted(imports_of(module, path, modules)) for module, path in sorted(modules.items())}


def cycles(edges: dict) -> list:
    """Every strongly connected component with more than one module (or a module importing itself): Tarjan."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quiet", action="store_true", help="print the cycles only")
    args = parser.parse_args(argv)
    edges = graph()
    if not args.quiet:
        width = max(map(len, edges))
        for module, targets in edges.items():
            print(f"{module:<{width}} -> {', '.join(targets) or '(nothing of the project)'}")
    found = cycles(edges)
    print("cycles: " + ("; ".join(" <-> ".join(c) for c in found) if found else "none"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
