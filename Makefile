# The two commands a newcomer needs:
#   make train   trains configs/tiny.yaml (creates .venv on first use)
#   make test    runs the whole test suite
# PYTHON=/path/to/python3.12 picks the interpreter; otherwise the first Python >= 3.12
# found among python3.13, python3.12, python3 and pyenv's versions folder is used.
SHELL := /bin/bash
VENV  := .venv
VPY   := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= configs/tiny.yaml
ARGS ?=

.PHONY: train test test-fast test-report test-jax011 venv bench clean
train: $(STAMP)
	$(VPY) -m jaxtrain train $(CONFIG) $(ARGS)

# --max-worker-restart=0: xdist 3.8 can hang replacing a crashed worker under loadfile
# (pytest-dev/pytest-xdist#784, #1313); a crash ends the run as a failure instead.
# --durations=20 and build/test-results.xml: the time budget is watched on every run (make test-report).
PYTEST := $(VPY) -m pytest -n auto --dist loadfile --max-worker-restart=0
test: $(STAMP)
	$(VPY) -m ruff check . && $(VPY) -m ruff format --check . && \
	$(PYTEST) --durations=20 --junitxml=build/test-results.xml $(ARGS)

# The inner loop: the unit tier, without notebooks, multi-process runs, deviceless pod compiles
# and the marked slow cases (docs/testing.md). make test stays the whole suite.
FAST := not notebook and not multiprocess and not deviceless and not slow
test-fast: $(STAMP)
	$(PYTEST) -m "$(FAST)" --durations=10 --junitxml=build/test-fast-results.xml $(ARGS)

# The last run's time per area against its budget, the ten slowest tests, every test over 60 s.
test-report:
	$(VPY) .ci/test_report.py $(or $(RESULTS),build/test-results.xml) $(ARGS)

# The GPU host runs jax 0.11.2 (CUDA 13); we pin 0.12.0.1. This runs the GPU-path tests (cuDNN
# attention and the dispatcher, the GPU memory plan, the launch flags, deviceless H100
# compiles, the model and its layer loop, the Hopper flash kernel in Mosaic GPU's interpreter
# and ptxas' report of it, the step profile's reading of HLO) under jax 0.11.2 in a venv of its
# own (docs/gpu.md).
JAX011 := .venv-jax011
test-jax011:
	@py="$$(bash .ci/find_python.sh)" || exit 1; \
	if [ ! -x $(JAX011)/bin/python ]; then "$$py" -m venv $(JAX011) && \
	$(JAX011)/bin/python -m pip install -q "jax==0.11.2" "jaxlib==0.11.2" "jax-cuda12-plugin==0.11.2" \
	  "jax-cuda12-pjrt==0.11.2" "nvidia-cudnn-cu12>=9.8,<10" pytest pytest-xdist && \
	$(JAX011)/bin/python -m pip install -q flax==0.12.12 optax==0.2.8 orbax-checkpoint==0.12.8 \
	  chex==0.1.92 "numpy>=2,<3" pyyaml rich tensorboardx safetensors "etils[epath]" gcsfs tokenizers \
	  zstandard && $(JAX011)/bin/python -m pip install -q --no-deps -e . ; fi
	$(JAX011)/bin/python -m pytest -p no:cacheprovider -n 2 tests/test_gpu_flags.py \
	  tests/test_cudnn_attention.py tests/test_gpu_memory_plan.py tests/test_model.py \
	  tests/test_flash_attention_deviceless.py tests/test_layer_scan.py tests/test_flash_mgpu.py \
	  tests/test_ptxas_report.py tests/test_data_movement.py tests/test_step_profile.py $(ARGS)

bench: $(STAMP)
	$(VPY) benchmarks/throughput.py $(ARGS)

venv: $(STAMP)

# Everything comes from pip: the project and its dev extras (nothing else is fetched).
$(STAMP): pyproject.toml
	@py="$$(bash .ci/find_python.sh)" || exit 1; \
	if [ ! -x $(VPY) ]; then echo "creating $(VENV) with $$py"; "$$py" -m venv $(VENV) || exit 1; fi; \
	$(VPY) -m pip install -q --upgrade pip && \
	$(VPY) -m pip install -q -e '.[dev]' && touch $(STAMP)

clean:
	rm -rf $(VENV) $(JAX011) build *.egg-info
