# make train       : set up .venv and run the default (tiny CPU) GRPO recipe
# make test        : set up .venv and run the whole test suite (what CI runs)
# make test-quick  : the suite without the slow end-to-end runs
# make test-unit   : tests/unit alone: no Ray, no vLLM, no subprocess, no process group (well under a minute)
# make test-multinode : tests/multinode alone: a real Slurm cluster of namespaced nodes on this machine (root)
# make setup-bench : .venv with the benchmarks' extras too (TRL for bench/grpo_vs_trl.py), through scripts/setup.sh
# make config-reference : regenerate docs/config_reference.md from the config dataclasses (a unit test checks it)
PY := .venv/bin/python
PYTEST := $(PY) -m pytest -p no:cacheprovider

.PHONY: setup setup-bench train test test-quick test-unit test-multinode config-reference
setup:
	bash scripts/setup.sh

# the CPU set's clean-up (scripts/setup.sh) must run after TRL's install too: a bare `pip install -e '.[cpu,bench]'`
# brings back torchvision/torchaudio, and then `import transformers` fails ("operator torchvision::nms does not exist")
setup-bench:
	NEMO_GRPO_EXTRAS=$${NEMO_GRPO_EXTRAS:-cpu,mcore,test,smollm2,judge},bench bash scripts/setup.sh

train: setup
	$(PY) -m nemo_grpo.train $(ARGS)

test: setup
	$(PYTEST) tests -v -rs --durations=30

test-quick: setup
	$(PYTEST) tests -m "not slow" -q -rs

test-unit: setup
	$(PYTEST) tests/unit -q -rs

test-multinode: setup
	$(PYTEST) tests/multinode -v -rs --durations=10

config-reference: setup
	$(PY) -m nemo_grpo.config_reference
