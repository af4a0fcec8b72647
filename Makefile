# Two commands do everything:
#   make run    set up .venv and run the main job
#   make test   set up .venv and run the whole test suite
# (and `make docs` builds the documentation site into build/site)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test setup clean demo-biases bench bench-seq2seq bench-thp bench-band upstream-tests compat compat-venvs compat-one docs

setup: $(STAMP)

$(STAMP): pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints-dev.txt torch
	$(PY) -m pip install --quiet -c constraints-dev.txt -e ".[test]"
	touch $(STAMP)

# The main job: train on the embedded corpus, then reload the saved folder through the Auto classes
# (trust_remote_code=True) and generate a sample. Re-running replaces runs/demo (--overwrite); the earlier
# run's checkpoints are renamed aside, not deleted.
run: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)/bin/hf-relpos train --output-dir runs/demo --steps 300 --overwrite
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)/bin/hf-relpos generate runs/demo --prompt "The for statement"

# Speed and memory against upstream T5 and plain attention (writes results/bench-cpu.md).
bench: $(STAMP)
	$(PY) scripts/bench.py

# The seq2seq section alone: upstream T5ForConditionalGeneration against from_t5 (writes results/bench-cpu-seq2seq.md).
bench-seq2seq: $(STAMP)
	$(PY) scripts/bench.py --seq2seq

# The effect of THP_MEM_ALLOC_ENABLE=1 on training steps (writes results/bench-cpu-thp.md).
bench-thp: $(STAMP)
	$(PY) scripts/bench_thp.py

# The band decomposition alone: where it beats the form it replaces, for Shaw and for the T5 bias
# (bidirectional and causal); writes results/bench-band-shaw.md, -t5_bias.md, -t5_bias-causal.md.
bench-band: $(STAMP)
	$(PY) scripts/bench_band.py --scheme shaw
	$(PY) scripts/bench_band.py --scheme t5_bias
	$(PY) scripts/bench_band.py --scheme t5_bias --causal

# What each scheme adds to attention, printed for a small example.
demo-biases: $(STAMP)
	$(PY) scripts/demo_biases.py

# The suite on every core (pytest-xdist): one worker process per CPU this process may use (nproc: affinity and
# cpusets counted; PYTEST_WORKERS=0 runs it in this one process, for -s or --pdb); --dist loadgroup hands out
# single tests, except that a module marked xdist_group (one that builds shared fixtures: trained folders,
# exported programs, servers) runs whole in one worker. Each worker uses one thread.
PYTEST_WORKERS ?= $(shell nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadgroup
# The ten slowest tests of each run, in the log (docs/guides/tests.md keeps them before and after issue 34).
PYTEST_REPORT := --durations=10

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_REPORT)

# The documentation site (mkdocs.yml, docs/): MkDocs with the Material theme and an API reference from the
# docstrings (mkdocstrings), built offline into build/site; --strict fails on any warning (a broken link, an
# unresolved reference, a docstring griffe cannot read). Its packages are the `docs` extra, pinned in
# constraints-dev.txt and installed once (the stamp), so `make test` does not need them.
DOCS_STAMP := $(VENV)/.docs-deps

$(DOCS_STAMP): $(STAMP) pyproject.toml constraints-dev.txt
	$(PY) -m pip install --quiet -c constraints-dev.txt -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

clean:
	rm -rf $(VENV) $(VENV)-tf* build *.egg-info .pytest_cache .hypothesis

# The compatibility job (CI runs it after `make test`): on the oldest and the newest Transformers hf_relpos is
# tested with (hf_relpos/versions.py; tests/test_compat.py keeps this list, that file and pyproject.toml equal),
# each in a virtual environment of its own with the built wheel and the development torch:
#   - the whole test suite on the newest; on the oldest the tests marked transformers_dependent (tests/conftest.py);
#   - the main job (`make run`'s commands) gives the text it gives under the development pin, and its folder
#     decodes to that text under the development pin too;
#   - folders saved under the development pin decode identically through remote code under this version, and
#     folders saved under this version under the development pin (scripts/cross_version.py).
COMPAT_TRANSFORMERS ?= 5.21.0 5.24.0
TORCH_PIN := $(shell sed -n 's/^torch==//p' constraints-dev.txt)
RUN_ARGS := --steps 300 --overwrite
PROMPT := "The for statement"

compat: $(STAMP) compat-venvs
	rm -rf build/compat build/lib build/bdist.* && mkdir -p build/compat
	$(PY) -m pip wheel --quiet --no-deps -w build/compat/wheel .
	$(PY) scripts/cross_version.py save build/compat/dev
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)/bin/hf-relpos train --output-dir runs/compat-dev $(RUN_ARGS) --quiet
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)/bin/hf-relpos generate runs/compat-dev --prompt $(PROMPT) \
		> build/compat/generate-dev.txt
	for version in $(COMPAT_TRANSFORMERS); do $(MAKE) --no-print-directory compat-one TF=$$version || exit 1; done

# One virtual environment per tested Transformers: the development torch, that Transformers and the dependencies
# of the wheel's `test` extra, rebuilt when pyproject.toml or the pins change. `make -j2 compat-venvs` builds
# them side by side (pip runs on one core; .ci/run does so before `make test`); compat-one installs the wheel it
# tests over them.
COMPAT_VENVS := $(foreach version,$(COMPAT_TRANSFORMERS),$(VENV)-tf$(version)/.installed)
compat-venvs: $(COMPAT_VENVS)

# (setuptools builds in build/lib and copies all of it into the wheel: emptied first, so that a module deleted
# from the source is not shipped from an earlier build)
build/compat-deps/.built: $(STAMP) pyproject.toml
	rm -rf build/compat-deps build/lib build/bdist.* && mkdir -p build/compat-deps
	$(PY) -m pip wheel --quiet --no-deps -w build/compat-deps/wheel .
	touch $@

$(VENV)-tf%/.installed: build/compat-deps/.built constraints-dev.txt
	rm -rf $(VENV)-tf$*
	$(PYTHON) -m venv $(VENV)-tf$*
	$(VENV)-tf$*/bin/python -m pip install --quiet --upgrade pip
	$(VENV)-tf$*/bin/python -m pip install --quiet "torch==$(TORCH_PIN)"
	$(VENV)-tf$*/bin/python -m pip install --quiet "torch==$(TORCH_PIN)" "transformers==$*" \
		"$$(ls build/compat-deps/wheel/hf_relpos-*.whl)[test]"
	touch $@

# The suite against the oldest tested Transformers: the tests marked transformers_dependent (tests/conftest.py);
# against the newest: all of them.
COMPAT_OLDEST := $(firstword $(COMPAT_TRANSFORMERS))

compat-one: $(VENV)-tf$(TF)/.installed
	@echo "== compatibility: transformers $(TF), torch $(TORCH_PIN)"
	$(VENV)-tf$(TF)/bin/python -m pip install --quiet --no-deps --force-reinstall "$$(ls build/compat/wheel/hf_relpos-*.whl)"
	$(VENV)-tf$(TF)/bin/hf-relpos --version
	HF_RELPOS_TEST_INSTALLED=1 OMP_NUM_THREADS=1 $(VENV)-tf$(TF)/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_PARALLEL) $(PYTEST_REPORT) \
		$(if $(filter $(TF),$(COMPAT_OLDEST)),-m transformers_dependent)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)-tf$(TF)/bin/hf-relpos train --output-dir runs/compat-$(TF) $(RUN_ARGS)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)-tf$(TF)/bin/hf-relpos generate runs/compat-$(TF) --prompt $(PROMPT) \
		> build/compat/generate-$(TF).txt
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)/bin/hf-relpos generate runs/compat-$(TF) --prompt $(PROMPT) \
		> build/compat/generate-$(TF)-read-by-dev.txt
	cat build/compat/generate-$(TF).txt
	cmp build/compat/generate-$(TF).txt build/compat/generate-dev.txt
	cmp build/compat/generate-$(TF).txt build/compat/generate-$(TF)-read-by-dev.txt
	$(VENV)-tf$(TF)/bin/python scripts/cross_version.py check build/compat/dev
	$(VENV)-tf$(TF)/bin/python scripts/cross_version.py save build/compat/tf$(TF)
	$(PY) scripts/cross_version.py check build/compat/tf$(TF)

# Transformers' own common model tests (ModelTesterMixin, GenerationTesterMixin, ConfigTester) on every
# scheme, causal, bidirectional and encoder-decoder, from the Transformers sdist (see scripts/upstream_common_tests.py).
# UPSTREAM_ARGS are pytest arguments, e.g. make upstream-tests UPSTREAM_ARGS="-q -k Rope -x"; RELPOS_SCHEMES,
# RELPOS_MODES (causal,bidirectional,seq2seq), RELPOS_PROBE too.
UPSTREAM_STAMP := $(VENV)/.upstream-test-deps
UPSTREAM_ARGS ?= -q -n 2

$(UPSTREAM_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c constraints-dev.txt parameterized pytest-timeout pytest-xdist httpx
	touch $(UPSTREAM_STAMP)

upstream-tests: $(UPSTREAM_STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) scripts/upstream_common_tests.py $(UPSTREAM_ARGS)
