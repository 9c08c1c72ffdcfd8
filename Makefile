# Two entry points: `make plan` (main job) and `make test`. Both create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: plan test fuzz bench bench-full browser clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,viz]"
	touch $(STAMP)

plan: $(STAMP)
	XLA_FLAGS="--xla_force_host_platform_device_count=8" $(BIN)/planner plan --model gpt2-small --mesh 2x4

# The HTML report test renders the page in headless Chromium. Installing it is part of the test set-up
# (Debian's package, as root); where that is not possible the test skips and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	      echo "installing chromium (Debian package) for the HTML report test"; \
	      (DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
	       { DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null 2>&1 && \
	         DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; }) || \
	      echo "chromium could not be installed; the HTML rendering test will skip"; \
	    else echo "chromium is not installed and apt-get needs root; the HTML rendering test will skip"; fi; }

test: $(STAMP) browser
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=25 tests

fuzz: $(STAMP)
	FUZZ_EXAMPLES=1000 ZOO_MESHES=2x4,1x8 $(BIN)/python -m pytest -q -n 2 tests/test_fuzz.py tests/test_zoo_numerics.py
	PIPELINE_FUZZ_EXAMPLES=1000 $(BIN)/python -m pytest -q -n 2 tests/test_pipeline_control_flow.py

bench: $(STAMP)
	XLA_FLAGS="--xla_force_host_platform_device_count=8" $(BIN)/python experiments/bench_gpt_baselines.py
	XLA_FLAGS="--xla_force_host_platform_device_count=8" $(BIN)/python experiments/bench_suite.py

# The rest of the comparison suite (every zoo size on 1x8/2x4/8x8/128x8, added to suite.csv): hours on 2 cores.
bench-full: $(STAMP)
	XLA_FLAGS="--xla_force_host_platform_device_count=8" $(BIN)/python experiments/bench_suite.py --set full --append

clean:
	rm -rf $(VENV) build *.egg-info
