# labkit: the two commands a user needs are `make lab` and `make test` (see README.md).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
BUILD := build
# Our CPU machines install this torch build from local disk; GPU nodes use environment.yml.
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
# PyPI's torch 2.14 is a CUDA 13 build without Volta kernels: on a V100 node run
# `make lab TORCH_INDEX=https://download.pytorch.org/whl/cu126` (docs/gpu-node.md).
TORCH_INDEX ?=
TORCH_FROM := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple)
# DeepSpeed JIT-builds its C++ ops on first use; keep that cache inside the repo's ignored build dir.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(BUILD)/torch_extensions
export MPLBACKEND := Agg
PYTEST_ARGS ?=

.PHONY: lab test test-fast test-changed test-profile smoke venv kernel clean-notebooks clean bench slides chromium bubblewrap

$(BIN)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=python3 ...'"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install $(TORCH_FROM) $(TORCH_PINS)
	$(BIN)/python -m pip install $(TORCH_FROM) $(TORCH_PINS) -e '.[test]'
	$(BIN)/python -m ipykernel install --sys-prefix --name labkit --display-name "labkit (Python 3)"
	touch $@

venv: $(BIN)/.installed

kernel: venv
	$(BIN)/python -m ipykernel install --sys-prefix --name labkit --display-name "labkit (Python 3)"

# LAB_ARGS passes options to JupyterLab, e.g. LAB_ARGS="--no-browser --port 8888" on a remote node.
LAB_ARGS ?=
lab: venv
	$(BIN)/jupyter lab --notebook-dir=notebooks $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_ARGS)

# The whole suite on 2 pytest-xdist workers; tests/_schedule.py groups each file (and files sharing a fixture)
# and sends the heaviest first. PYTEST_ARGS="-n 0" runs it in one process. docs/DEVELOPING.md, "The suite".
XDIST ?= -n 2 --dist loadgroup --no-loadscope-reorder
test: venv chromium bubblewrap
	mkdir -p $(BUILD)
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# The inner loop (under 3 minutes): no notebook execution, no multi-process job (tests not marked slow).
test-fast: venv
	$(BIN)/python -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

# The tests that import what the working tree changed since BASE (HEAD: uncommitted work; BASE=main: a branch).
BASE ?= HEAD
test-changed: venv
	$(BIN)/python tests/_changed.py --base $(BASE) -- $(XDIST) $(PYTEST_ARGS)

# The whole suite with the time by kind (tests/_profile.py) printed at the end and kept in build/test-profile.jsonl.
test-profile: venv chromium bubblewrap
	mkdir -p $(BUILD)
	rm -f $(BUILD)/test-profile.jsonl
	$(BIN)/python -m pytest $(XDIST) --kind-profile $(BUILD)/test-profile.jsonl $(PYTEST_ARGS)

smoke: venv
	$(BIN)/labkit notebooks run --profile smoke --out $(BUILD)/executed

bench: venv
	for f in bench/*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

# Slides are rendered and checked in Debian's headless Chromium (tests/test_slides.py too).
chromium:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update && apt-get install -y chromium; \
	  else echo "error: /usr/bin/chromium is missing: run 'sudo apt-get install -y chromium' (Debian/Ubuntu), then retry"; exit 1; fi; \
	fi

# `labkit grade --execute` runs each notebook in Debian's bubblewrap sandbox (tests/test_grading_isolation.py).
bubblewrap:
	@if [ ! -x /usr/bin/bwrap ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update && apt-get install -y bubblewrap; \
	  else echo "error: /usr/bin/bwrap is missing: run 'sudo apt-get install -y bubblewrap' (Debian/Ubuntu), then retry"; exit 1; fi; \
	fi

slides: venv chromium
	$(BIN)/labkit slides build --out $(BUILD)/slides

clean-notebooks: venv
	$(BIN)/labkit notebooks clean notebooks/*.ipynb reservations/*.ipynb

clean:
	rm -rf $(BUILD) .pytest_cache
