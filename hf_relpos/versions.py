"""The versions of Transformers and torch that hf_relpos is tested with, and the check ``import hf_relpos`` runs.

Standard library only: the command line reads this file without importing torch or Transformers
(``hf-relpos --version`` answers at once). The Makefile's compatibility job (``make compat``) runs the test
suite on ``TESTED_TRANSFORMERS``' ends, ``pyproject.toml`` declares its lower end, and
``tests/test_versions.py`` keeps the three equal.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

# The oldest and newest Transformers the whole suite passes on (CI: `make test` on the development pin between
# them, `make compat` on both ends). 5.21 is the first with every API the models use (`slice_logits_to_keep`;
# `Cache.get_query_offset` and `get_mask_sizes(query_length, layer_idx)` came in 5.14-5.18).
TESTED_TRANSFORMERS = ("5.21.0", "5.25.0")
# torch releases the whole suite has passed on, each with the Transformers it ran with: CI's pin (a CPU wheel) with
# the whole range; by hand (multi-GB CUDA builds on a CPU machine, 2026-11-24) the oldest torch with the oldest
# tested Transformers, and the newest torch with the newest Transformers, which is what a fresh
# `pip install hf_relpos` resolves to. (torch 2.6, the oldest Transformers 5 accepts, fails only torch.compile:
# `torch.compiler.is_exporting`, which Transformers' compiled code calls, came in 2.7.)
TESTED_TORCH = {
    "2.7.1": (TESTED_TRANSFORMERS[0], TESTED_TRANSFORMERS[0]),
    "2.13.0": TESTED_TRANSFORMERS,
    "2.15.0": ("5.24.0", "5.24.0"),  # with 5.25 not installable here (2026-12-06: its CUDA dependencies)
}


def release(text: str) -> tuple[int, ...]:
    """``"5.24.0"`` -> ``(5, 24, 0)``; local and pre-release tags (``+cpu``, ``.dev0``, ``rc1``) dropped."""
    numbers = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(part) for part in numbers.group(0).split(".")) if numbers else ()


def installed(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _within(text: str, low: str, high: str) -> bool:
    """Within ``[low, high]`` by minor release: a patch release of a tested minor (5.24.1) is a bug-fix release of
    a tested one, and warning about each would teach users to ignore the warning."""
    return release(low)[:2] <= release(text)[:2] <= release(high)[:2]


def transformers_tested(transformers_version: str) -> bool:
    return _within(transformers_version, *TESTED_TRANSFORMERS)


def torch_tested(torch_version: str) -> bool:
    return any(release(torch_version)[:3] == release(v) for v in TESTED_TORCH)


def tested_together(torch_version: str, transformers_version: str) -> bool:
    """Whether the suite has passed on this torch release with a Transformers in the range it ran with."""
    return any(
        release(torch_version)[:3] == release(v) and _within(transformers_version, *TESTED_TORCH[v]) for v in TESTED_TORCH
    )


def untested_transformers_warning(transformers_version: str) -> str | None:
    """The one-line warning for a Transformers outside the tested range, or None inside it."""
    if transformers_tested(transformers_version):
        return None
    low, high = TESTED_TRANSFORMERS
    return (
        f"hf_relpos is tested with transformers {low} to {high}; transformers {transformers_version} is installed "
        f"(untested: pip install 'transformers>={low},<={high}' for a tested one)"
    )


def report() -> str:
    """What ``hf-relpos --version`` prints: hf_relpos, torch and Transformers, and whether they are tested together."""
    ours, torch_version, transformers_version = (installed(p) for p in ("hf_relpos", "torch", "transformers"))
    low, high = TESTED_TRANSFORMERS
    pairs = "; ".join(f"torch {t} with transformers {a}" + (f" to {b}" if b != a else "") for t, (a, b) in TESTED_TORCH.items())
    together = bool(torch_version and transformers_version) and tested_together(torch_version, transformers_version)
    return "\n".join([
        f"hf-relpos {ours or 'unknown (not installed)'}",
        f"torch {torch_version or 'not installed'}",
        f"transformers {transformers_version or 'not installed'} (tested: {low} to {high})",
        f"tested together: {'yes' if together else 'no'} (tested: {pairs})",
    ])
