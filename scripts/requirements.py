"""Print hf_relpos' requirements with the given extras, one per line, for ``pip install -r``.

    python scripts/requirements.py test > requirements.txt

``make compat-venvs`` installs the compatibility environments' dependencies from this list, read from
pyproject.toml, instead of from a wheel built first: building writes ``build/`` and ``*.egg-info`` in the checkout,
which ``make setup``'s editable install, run beside it (``make -j3 setup compat-venvs``), writes too. An extra that
names ``hf_relpos[other]`` brings that extra's requirements in its place.
"""

import sys
import tomllib
from pathlib import Path

PROJECT = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]


def requirements(extras: list[str]) -> list[str]:
    """The project's dependencies and those of ``extras``, self-references (``hf_relpos[x]``) expanded."""
    found, pending, seen = list(PROJECT["dependencies"]), list(extras), set()
    while pending:
        extra = pending.pop(0)
        if extra in seen:
            continue
        if extra not in PROJECT["optional-dependencies"]:
            sys.exit(f"scripts/requirements.py: no extra {extra!r} (pyproject.toml has "
                     f"{', '.join(sorted(PROJECT['optional-dependencies']))})")
        seen.add(extra)
        for requirement in PROJECT["optional-dependencies"][extra]:
            name, bracket, rest = requirement.partition("[")
            if name.strip() == PROJECT["name"]:
                pending.extend(part.strip() for part in rest.rstrip("]").split(","))
            elif requirement not in found:
                found.append(requirement)
    return found


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))
