"""The project as a user gets it from ``pip install``: a built wheel, not this checkout.

The model-card templates (the top-level ``model_cards/*.md``) ship as the data package ``hf_relpos.model_cards``
(``pyproject.toml``: a ``package-dir`` mapping and ``package-data``); without it a wheel ships the code but no
templates, and ``hf-relpos train`` fails at its very end, when it writes the model card.
The editable install the rest of the suite runs against cannot see this, so this test:

1. copies the checkout's source files (git's tracked and non-ignored files; without git, everything
   but virtual environments, build outputs and caches) to a temporary folder, so that no stale
   ``build/`` or ``*.egg-info`` of the checkout leaks into the wheel and the checkout is left untouched;
2. builds a wheel there with ``pip wheel --no-deps --no-build-isolation --no-index`` (offline: the
   venv's own setuptools is the build backend), verbosely, and fails on any setuptools warning in the
   build's output (such as "Package would be ignored", which a data folder inside the package gave);
3. checks the wheel's contents: every ``.py`` and every model-card template of the package, the
   ``hf-relpos`` entry point of ``pyproject.toml`` and the module it names, the licence;
4. installs it with ``pip install --no-deps --no-index --target`` into a fresh folder outside the checkout;
5. from another temporary folder, with ``PYTHONPATH`` = that folder only (the venv's editable finder
   for the checkout comes after ``PYTHONPATH``; a probe checks that ``hf_relpos`` is imported from the
   install), runs the installed ``hf-relpos`` script's ``train --help`` (the flags below exist), then
   ``python -m hf_relpos.cli train`` on tiny settings, and checks that it writes
   ``model.safetensors``, ``config.json`` and a ``README.md`` model card filled in from its template.

Skipped, with the reason, only when a wheel cannot be built offline at all (no pip, or no setuptools
new enough for ``pyproject.toml``'s ``[build-system]``). 20-40 s on two CPU cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# One pytest-xdist worker runs this whole module (make test: --dist loadgroup): its shared fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_packaging")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hf_relpos"
# Never copied into the build folder (the fallback when git cannot list the source files).
NOT_SOURCE = (".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".pytest_cache", ".hypothesis", "runs", "out")
TRAIN_ARGS = [
    "train", "--position-encoding", "t5_bias", "--preset", "tiny", "--steps", "2", "--seq-len", "16",
    "--batch-size", "2", "--vocab-size", "300", "--eval-tokens", "64", "--quiet",
]  # fmt: skip


def _run(cmd, *, cwd, env=None, timeout=300):
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    )
    return result


def _offline_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(
        PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), PYTHONDONTWRITEBYTECODE="1",
    )  # fmt: skip
    env.update(extra)
    return env


def _pyproject() -> dict:
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = None
    if tomllib is not None:
        return tomllib.loads(text)
    requires = re.search(r"^requires\s*=\s*\[([^\]]*)\]", text, re.M)
    scripts = dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.]+:\w+)"', text, re.M))
    return {"build-system": {"requires": re.findall(r'"([^"]+)"', requires.group(1)) if requires else []},
            "project": {"scripts": scripts}}  # fmt: skip


def _skip_unless_buildable_offline() -> None:
    """Skip (with the reason) when this interpreter cannot build the wheel without the network."""
    from importlib.metadata import PackageNotFoundError, version

    try:  # metadata only: importlib.util.find_spec("pip") would let setuptools' distutils hack unload distutils here
        version("pip")
    except PackageNotFoundError:
        pytest.skip(f"cannot build a wheel offline: pip is not installed for {sys.executable}")
    for requirement in _pyproject().get("build-system", {}).get("requires", []):
        name, _, minimum = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(>=\s*([\d.]+))?", requirement).group(1, 2, 3)
        try:
            have = version(name)
        except PackageNotFoundError:
            pytest.skip(f"cannot build a wheel offline (--no-build-isolation): build requirement {name} is not installed")
        if minimum:
            as_tuple = lambda v: tuple(int(p) for p in re.findall(r"\d+", v)[:3])  # noqa: E731
            if as_tuple(have) < as_tuple(minimum):
                pytest.skip(
                    f"cannot build a wheel offline (--no-build-isolation): pyproject.toml's [build-system] "
                    f"needs {requirement}, this venv has {name} {have}"
                )


def _copy_source(target: Path) -> None:
    """The checkout's source files into ``target``: git's view of them when git is there, else a filtered copy."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True, timeout=60,
        ).stdout.decode().split("\0")  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        listed = None
    if not listed or "pyproject.toml" not in listed:
        shutil.copytree(ROOT, target, ignore=shutil.ignore_patterns(*NOT_SOURCE), symlinks=True)
        return
    for name in filter(None, listed):
        path = ROOT / name
        if path.is_file():  # a file deleted from the work tree is still "cached"
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / name)


def _entry_point() -> tuple[str, str]:
    scripts = _pyproject()["project"]["scripts"]
    assert "hf-relpos" in scripts, f"pyproject.toml declares no hf-relpos script: {scripts}"
    return "hf-relpos", scripts["hf-relpos"]


# What setuptools says when a build is not clean: a warning class (BuildBackendWarning, SetuptoolsDeprecationWarning,
# ...), the "!!" banner they are printed in, the message about a data folder inside a package that is not listed as
# one, and distutils' "warning: ..." log lines. (pip's own "WARNING:" lines, about its configuration, are not these.)
SETUPTOOLS_WARNING = re.compile(r"Package would be ignored|\w+Warning\b|^\s*!!\s*$|^\s*warning:", re.M)


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> tuple:
    """The wheel, and what its build printed (verbose: the build backend's own output included)."""
    _skip_unless_buildable_offline()
    work = tmp_path_factory.mktemp("packaging")
    source = work / "source"
    _copy_source(source)
    dist = work / "dist"
    env = _offline_env()
    env.pop("PYTHONDONTWRITEBYTECODE")  # else distutils warns "byte-compiling is disabled", which is this test's doing
    result = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-v", "-w", str(dist), str(source)],
        cwd=work, env=env,
    )  # fmt: skip
    wheels = sorted(dist.glob(f"{PACKAGE}-*.whl"))
    assert len(wheels) == 1, f"expected one {PACKAGE} wheel in {dist}, found {[w.name for w in dist.iterdir()]}"
    return wheels[0], result.stdout + result.stderr


@pytest.fixture(scope="module")
def wheel(build) -> Path:
    return build[0]


def test_the_build_prints_no_setuptools_warning(build):
    _, output = build
    assert "adding 'hf_relpos/" in output, "the build's own output is missing (pip -v shows the backend's)"
    warnings = [line for line in output.splitlines() if SETUPTOOLS_WARNING.search(line)]
    at = output.find(warnings[0]) if warnings else 0
    assert not warnings, f"setuptools warned during the build:\n{output[max(0, at - 1500):at + 1500]}"


def test_wheel_contents(wheel):
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    cards = sorted((ROOT / "model_cards").glob("*.md"))
    assert len(cards) >= 8, f"expected a model-card template per scheme, found {[c.name for c in cards]}"
    assert not (ROOT / PACKAGE / "model_cards").exists(), "model_cards/ is the top-level folder, the single source"
    missing = [f"{PACKAGE}/model_cards/{c.name}" for c in cards if f"{PACKAGE}/model_cards/{c.name}" not in names]
    assert not missing, f"model-card templates missing from {wheel.name} (package-data in pyproject.toml?): {missing}"
    shipped = {n.rsplit("/", 1)[1] for n in names if n.startswith(f"{PACKAGE}/model_cards/") and n.endswith(".md")}
    assert shipped == {c.name for c in cards}, f"{wheel.name} ships other templates than model_cards/: {sorted(shipped)}"
    modules = [p.relative_to(ROOT).as_posix() for p in (ROOT / PACKAGE).rglob("*.py")]
    assert f"{PACKAGE}/commands/train.py" in modules, "the command modules were not found in the checkout"
    assert not [m for m in modules if m not in names], f"modules missing from {wheel.name}: {sorted(set(modules) - names)}"
    assert not [n for n in names if n.startswith(("tests/", "scripts/", "results/"))], "test or result files in the wheel"

    dist_info = {n.split("/", 1)[1]: n for n in names if re.match(rf"{PACKAGE}-[^/]+\.dist-info/", n)}
    script, target = _entry_point()
    entry_points = archive.read(dist_info["entry_points.txt"]).decode()
    assert re.search(rf"^{re.escape(script)}\s*=\s*{re.escape(target)}$", entry_points, re.M), entry_points
    module = target.split(":")[0]
    module_files = (module.replace(".", "/") + ".py", module.replace(".", "/") + "/__init__.py")
    assert names & set(module_files), f"{script} runs {target}, but {wheel.name} holds none of {module_files}"

    metadata = archive.read(dist_info["METADATA"]).decode()
    assert re.search(r"^License-Expression: Apache-2.0$", metadata, re.M), "License-Expression missing from METADATA"
    if (ROOT / "LICENSE").exists():
        assert "licenses/LICENSE" in dist_info, f"LICENSE not shipped in {wheel.name}: {sorted(dist_info)}"


def test_installed_wheel_trains_and_writes_model_card(wheel, tmp_path):
    site = tmp_path / "site"
    _run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
        cwd=tmp_path, env=_offline_env(),
    )  # fmt: skip
    assert ROOT.resolve() not in site.resolve().parents

    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    env = _offline_env(PYTHONPATH=str(site))
    script, target = _entry_point()
    module = target.split(":")[0]
    probe = _run(
        [sys.executable, "-c", f"import importlib; [print(importlib.import_module(m).__file__) for m in ({PACKAGE!r}, {module!r})]"],
        cwd=elsewhere, env=env,
    )  # fmt: skip
    for line in probe.stdout.splitlines():
        assert Path(line).resolve().is_relative_to(site.resolve()), f"imported {line}, not the installed wheel under {site}"
    # every template, read as the commands read them (importlib.resources), from the installed wheel
    read = _run(
        [sys.executable, "-c", "from hf_relpos.commands.model_card import read_template, TEMPLATES; "
         "from importlib import resources; import sys; "
         "[print(t.name, len(read_template(t.name[:-3]))) for t in resources.files(TEMPLATES).iterdir() if t.name.endswith('.md')]; "
         "print(resources.files(TEMPLATES))"],
        cwd=elsewhere, env=env,
    )  # fmt: skip
    *templates, where = read.stdout.strip().splitlines()
    assert Path(where).resolve().is_relative_to(site.resolve()), f"templates read from {where}, not from {site}"
    assert sorted(t.split()[0] for t in templates) == sorted(c.name for c in (ROOT / "model_cards").glob("*.md"))
    assert all(int(t.split()[1]) > 100 for t in templates), templates

    installed_script = site / "bin" / script
    assert installed_script.is_file(), f"pip installed no {script} script into {site / 'bin'}"
    help_text = _run([sys.executable, str(installed_script), "train", "--help"], cwd=elsewhere, env=env).stdout
    flags = [a for a in TRAIN_ARGS if a.startswith("--")] + ["--output-dir"]
    assert not [f for f in flags if f not in help_text], f"`{script} train` lacks flags this test uses:\n{help_text}"

    out = tmp_path / "run"
    _run([sys.executable, "-m", "hf_relpos.cli", *TRAIN_ARGS, "--output-dir", str(out)], cwd=elsewhere, env=env, timeout=600)
    for name in ("model.safetensors", "config.json", "README.md"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, f"{name} not written to {out}"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "relpos" and config["position_encoding"] == "t5_bias"
    card = (out / "README.md").read_text()
    assert card.startswith("---\n"), "the model card has no YAML front matter"
    assert not re.search(r"\{\{\s*\w+\s*\}\}", card), "the model card has unfilled template fields"
    template = (ROOT / "model_cards" / "t5_bias.md").read_text()
    heading = next(line for line in template.splitlines() if line.startswith("# "))
    assert heading in card, f"the model card is not filled in from the t5_bias template ({heading!r} not in it)"
    assert not list(elsewhere.iterdir()), f"training wrote into the working directory: {list(elsewhere.iterdir())}"


@pytest.mark.skipif(bool(os.environ.get("HF_RELPOS_TEST_INSTALLED")), reason="about a checkout, not the installed wheel")
def test_templates_are_read_from_a_checkout_that_is_not_installed():
    """hf_relpos run from a source tree on PYTHONPATH, not installed (``python -S``: no site hooks, so no editable
    install's mapping of ``hf_relpos.model_cards``), reads the templates from the checkout's ``model_cards/``
    (review finding: `hf-relpos train` wrote no model card and crashed there)."""
    import sysconfig

    paths = [str(ROOT), *dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])]
    code = (
        "import hf_relpos.commands.model_card as m, importlib.util as u; "
        "assert u.find_spec('hf_relpos.model_cards') is None, 'the package mapping is present: not a bare checkout'; "
        "print(m.__file__); print(m.read_template('t5_bias'), end='')"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    module, text = out.stdout.split("\n", 1)
    assert Path(module).resolve().is_relative_to(ROOT), module
    assert text == (ROOT / "model_cards" / "t5_bias.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("extra", ["test", "export", "serve", "docs"])
def test_requirements_script_lists_what_the_installed_metadata_requires(extra):
    """scripts/requirements.py (make compat-venvs installs from it) gives the requirements pip resolves for
    ``hf_relpos[extra]`` from the installed package's metadata: the base ones and the extra's, self-references
    expanded."""
    import importlib.metadata
    import importlib.util

    from packaging.requirements import Requirement

    spec = importlib.util.spec_from_file_location("requirements_script", ROOT / "scripts" / "requirements.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def wanted(extra: str) -> set:
        requirements = [Requirement(text) for text in importlib.metadata.requires("hf_relpos")]
        extras, grown = {extra}, True
        while grown:  # the extras an extra brings through hf_relpos[...], to a fixed point
            before = set(extras)
            for requirement in requirements:
                if requirement.name == "hf_relpos" and any(requirement.marker.evaluate({"extra": e}) for e in extras):
                    extras |= requirement.extras
            grown = extras != before
        found = set()
        for requirement in requirements:
            if requirement.name == "hf_relpos":
                continue
            if requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in extras):
                requirement.marker = None
                found.add(str(requirement))
        return found

    got = {str(Requirement(text)) for text in script.requirements([extra])}
    assert got == wanted(extra)
