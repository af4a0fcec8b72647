# Two commands do everything:
#   make run    set up .venv and run the main job
#   make test   set up .venv and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints-dev.txt torch
	$(PY) -m pip install --quiet -c constraints-dev.txt -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) scripts/demo_biases.py

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
