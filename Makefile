# Two entry points: `make plan` (main job) and `make test`. Both create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: plan test fuzz bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,viz]"
	touch $(STAMP)

plan: $(STAMP)
	XLA_FLAGS="--xla_force_host_platform_device_count=8" $(BIN)/planner plan --model gpt2-small --mesh 2x4

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --durations=15 tests

fuzz: $(STAMP)
	FUZZ_EXAMPLES=1000 $(BIN)/python -m pytest -q -n 2 tests/test_fuzz.py

bench: $(STAMP)
	XLA_FLAGS="--xla_force_host_platform_device_count=8" $(BIN)/python experiments/bench_gpt_baselines.py

clean:
	rm -rf $(VENV) build *.egg-info
