# Two commands do everything:
#   make run    set up .venv and run the main job
#   make test   set up .venv and run the whole test suite
# (and `make docs` builds the documentation site into build/site)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: newest run test setup clean demo-biases bench bench-seq2seq bench-thp bench-band upstream-tests compat compat-venvs compat-tests docs docs-screens

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
# The thirty slowest tests of each run, in the log (docs/guides/tests.md keeps the ten slowest at each stop).
PYTEST_REPORT := --durations=30

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

# Then the site as a reader sees it (scripts/check_site.py): no list, table or code block run into a paragraph,
# no list nested too shallow for Python-Markdown, no image that does not resolve. --strict passes all of these.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site
	$(PY) scripts/check_site.py build/site --docs docs

# A screenshot of every guide in headless Chromium (Debian's `chromium` package), for a person to look at (not run
# by CI): the built site served on 127.0.0.1, one full-page PNG per page in build/screens/.
docs-screens: docs
	$(PY) scripts/docs_screens.py build/site --output build/screens

clean:
	rm -rf $(VENV) $(VENV)-tf* build *.egg-info .pytest_cache .hypothesis

# The compatibility job (CI runs it after `make test`, which runs the whole suite on the development pin, the newest
# Transformers hf_relpos is tested with): on the oldest (hf_relpos/versions.py; tests/test_compat.py keeps this
# list, that file, the pins and pyproject.toml equal), in a virtual environment of its own with the built wheel and
# the development torch:
#   - the tests marked transformers_dependent (tests/conftest.py);
#   - the main job (`make run`'s commands) gives the text it gives under the development pin, and its folder
#     decodes to that text under the development pin too;
#   - folders saved under the development pin decode identically through remote code under this version, and
#     folders saved under this version under the development pin (scripts/cross_version.py).
COMPAT_TRANSFORMERS ?= 5.21.0
TORCH_PIN := $(shell sed -n 's/^torch==//p' constraints-dev.txt)
RUN_ARGS := --steps 300 --overwrite
PROMPT := "The for statement"
# The main jobs and the cross-version folders run two at a time (make -j2), each on one thread (the dev pin's and
# every version's with the same thread count, so that their texts are comparable) and with a remote-code cache of
# its own (two loads of folders of the same name would write the same files in a shared one).
COMPAT_JOB_ENV = OMP_NUM_THREADS=1 HF_MODULES_CACHE=$(CURDIR)/build/compat/modules/$(notdir $@)

# First the suites, one version after the other (each already on every core), then the main jobs and the
# cross-version folders of all versions, two at a time (a training run keeps less than two cores busy, a
# cross-version check one).
compat: $(STAMP) compat-venvs
	rm -rf build/compat build/lib build/bdist.* && mkdir -p build/compat
	$(PY) -m pip wheel --quiet --no-deps -w build/compat/wheel .
	for version in $(COMPAT_TRANSFORMERS); do $(MAKE) --no-print-directory compat-tests TF=$$version || exit 1; done
	$(MAKE) --no-print-directory -j2 --output-sync=target $(foreach version,$(COMPAT_TRANSFORMERS),compat-check-$(version))

# One virtual environment per tested Transformers: the development torch, that Transformers and the requirements
# of the `test` extra (scripts/requirements.py reads them from pyproject.toml), rebuilt when pyproject.toml or the
# pins change. `make -j3 setup compat-venvs` builds them beside the development one (pip runs on one core;
# .ci/run does so); nothing is built in the checkout for them, so they do not race setup's editable install.
# compat-tests installs the wheel under test over them.
COMPAT_VENVS := $(foreach version,$(COMPAT_TRANSFORMERS),$(VENV)-tf$(version)/.installed)
compat-venvs: $(COMPAT_VENVS)

$(VENV)-tf%/.installed: pyproject.toml constraints-dev.txt scripts/requirements.py
	rm -rf $(VENV)-tf$*
	$(PYTHON) -m venv $(VENV)-tf$*
	$(PYTHON) scripts/requirements.py test > $(VENV)-tf$*/requirements.txt
	$(VENV)-tf$*/bin/python -m pip install --quiet --upgrade pip
	$(VENV)-tf$*/bin/python -m pip install --quiet "torch==$(TORCH_PIN)"
	$(VENV)-tf$*/bin/python -m pip install --quiet "torch==$(TORCH_PIN)" "transformers==$*" -r $(VENV)-tf$*/requirements.txt
	touch $@

# The suite against the oldest tested Transformers: the tests marked transformers_dependent (tests/conftest.py);
# against any other version in COMPAT_TRANSFORMERS (none by default: `make test` runs the newest), all of them.
# The wheel under test (built by `make compat`) is installed over the venv first.
COMPAT_OLDEST := $(firstword $(COMPAT_TRANSFORMERS))

compat-tests: $(VENV)-tf$(TF)/.installed
	@echo "== compatibility: transformers $(TF), torch $(TORCH_PIN)"
	$(VENV)-tf$(TF)/bin/python -m pip install --quiet --no-deps --force-reinstall "$$(ls build/compat/wheel/hf_relpos-*.whl)"
	$(VENV)-tf$(TF)/bin/hf-relpos --version
	HF_RELPOS_TEST_INSTALLED=1 OMP_NUM_THREADS=1 $(VENV)-tf$(TF)/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_PARALLEL) $(PYTEST_REPORT) \
		$(if $(filter $(TF),$(COMPAT_OLDEST)),-m transformers_dependent)

# The main job under the development pin, and its folders for the other versions to decode.
build/compat/generate-dev.txt:
	$(COMPAT_JOB_ENV) $(VENV)/bin/hf-relpos train --output-dir runs/compat-dev $(RUN_ARGS) --quiet
	$(COMPAT_JOB_ENV) $(VENV)/bin/hf-relpos generate runs/compat-dev --prompt $(PROMPT) > $@.part && mv $@.part $@

build/compat/dev/expected.json:
	$(COMPAT_JOB_ENV) $(PY) scripts/cross_version.py save build/compat/dev

# The main job under one version: its text, and the same folder decoded under the development pin.
build/compat/generate-%.txt:
	$(COMPAT_JOB_ENV) $(VENV)-tf$*/bin/hf-relpos train --output-dir runs/compat-$* $(RUN_ARGS) --quiet
	$(COMPAT_JOB_ENV) $(VENV)-tf$*/bin/hf-relpos generate runs/compat-$* --prompt $(PROMPT) > $@.part
	$(COMPAT_JOB_ENV) $(VENV)/bin/hf-relpos generate runs/compat-$* --prompt $(PROMPT) > build/compat/generate-$*-read-by-dev.txt
	mv $@.part $@

.PRECIOUS: build/compat/generate-%.txt  # kept after the checks (make deletes what a pattern rule made in passing)

# One version against the development pin: the same main-job text both ways, the development pin's folders
# decoded under this version and this version's under the development pin.
compat-check-%: build/compat/generate-%.txt build/compat/generate-dev.txt build/compat/dev/expected.json
	@echo "== compatibility: transformers $*: the main job's text"
	cat build/compat/generate-$*.txt
	cmp build/compat/generate-$*.txt build/compat/generate-dev.txt
	cmp build/compat/generate-$*.txt build/compat/generate-$*-read-by-dev.txt
	$(COMPAT_JOB_ENV) $(VENV)-tf$*/bin/python scripts/cross_version.py check build/compat/dev
	$(COMPAT_JOB_ENV) $(VENV)-tf$*/bin/python scripts/cross_version.py save build/compat/tf$*
	$(COMPAT_JOB_ENV) $(PY) scripts/cross_version.py check build/compat/tf$*

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

# The next Transformers release, checked with one command (not run by CI): the newest 5.x the registry serves,
# unpinned, in a virtual environment of its own with the development torch, the tests marked transformers_dependent
# and a serve smoke test (tests/test_serve.py). docs/guides/supported-versions.md says how to move the pin after.
NEWEST_VENV := $(VENV)-newest

newest: $(STAMP)
	rm -rf $(NEWEST_VENV) build/newest build/lib build/bdist.* && mkdir -p build/newest
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(PYTHON) scripts/requirements.py test > build/newest/requirements.txt
	$(NEWEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(NEWEST_VENV)/bin/python -m pip install --quiet "torch==$(TORCH_PIN)"
	$(NEWEST_VENV)/bin/python -m pip install --quiet --upgrade "torch==$(TORCH_PIN)" "transformers>=5,<6" -r build/newest/requirements.txt
	$(PY) -m pip wheel --quiet --no-deps -w build/newest/wheel .
	$(NEWEST_VENV)/bin/python -m pip install --quiet --no-deps --force-reinstall "$$(ls build/newest/wheel/hf_relpos-*.whl)"
	$(NEWEST_VENV)/bin/hf-relpos --version
	HF_RELPOS_TEST_INSTALLED=1 OMP_NUM_THREADS=1 $(NEWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_PARALLEL) \
		-m transformers_dependent
