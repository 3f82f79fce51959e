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

.PHONY: lab test smoke rehearse venv kernel clean-notebooks clean bench slides chromium bubblewrap

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

test: venv chromium bubblewrap
	mkdir -p $(BUILD)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

smoke: venv
	$(BIN)/labkit notebooks run --profile smoke --out $(BUILD)/executed

# The week before class, on any machine: every notebook as PROFILE's node runs it, on CPU (docs/gpu-node.md).
PROFILE ?= a100x4
rehearse: venv
	$(BIN)/labkit notebooks run --profile $(PROFILE) --rehearse --out $(BUILD)/rehearsed/$(PROFILE)

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
