# make train       : set up .venv and run the default (tiny CPU) GRPO recipe
# make test        : set up .venv and run the whole test suite (what CI runs)
# make test-quick  : the suite without the slow end-to-end runs
# make test-unit   : tests/unit alone: no Ray, no vLLM, no subprocess, no process group (well under a minute)
PY := .venv/bin/python
PYTEST := $(PY) -m pytest -p no:cacheprovider

.PHONY: setup train test test-quick test-unit
setup:
	bash scripts/setup.sh

train: setup
	$(PY) -m nemo_grpo.train $(ARGS)

test: setup
	$(PYTEST) tests -v -rs --durations=30

test-quick: setup
	$(PYTEST) tests -m "not slow" -q -rs

test-unit: setup
	$(PYTEST) tests/unit -q -rs
