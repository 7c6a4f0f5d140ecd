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

.PHONY: train test venv bench clean
train: $(STAMP)
	$(VPY) -m jaxtrain train $(CONFIG) $(ARGS)

# --max-worker-restart=0: xdist 3.8 can hang replacing a crashed worker under loadfile
# (pytest-dev/pytest-xdist#784, #1313); a crash ends the run as a failure instead.
test: $(STAMP)
	$(VPY) -m ruff check . && $(VPY) -m ruff format --check . && $(VPY) -m pytest -n auto --dist loadfile --max-worker-restart=0 $(ARGS)

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
	rm -rf $(VENV) build *.egg-info
