# Two commands do everything:
#   make run    set up .venv and run the main job
#   make test   set up .venv and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test setup clean demo-biases bench bench-seq2seq bench-thp bench-band upstream-tests

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

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

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
