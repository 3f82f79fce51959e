# labkit: the two commands a user needs are `make lab` and `make test` (see README.md).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
BUILD := build
# The class's locked environment (requirements/lock.txt, written by `make lock`): every install
# below, environment.yml and the container recipes install with `-c $(LOCK)` (docs/gpu-node.md).
LOCK := requirements/lock.txt
# torch/torchvision as locked; our CPU machines install this build from local disk.
TORCH_PINS = $(shell grep -E '^torch(vision)?==' $(LOCK))
# On a GPU node the wheel index follows the driver: labkit/runtime/cudadriver.py picks the newest CUDA build
# of the locked torch that the driver supports and that has kernels for every GPU (without a driver: the
# CPU build, below). PyPI's torch 2.14 is a CUDA 13.0 build without Volta kernels: on a V100
# node that is https://download.pytorch.org/whl/cu126 (driver >= 560.28.03); to choose it yourself,
# `make lab TORCH_INDEX=https://download.pytorch.org/whl/cu126` (docs/gpu-node.md). Without an NVIDIA driver: the
# locked torch's CPU build from CPU_INDEX (a few hundred MB instead of gigabytes of CUDA libraries), or PyPI's
# build, said in one line, when CPU_INDEX cannot be reached (our CI machines reach PyPI only).
TORCH_INDEX ?=
CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX_CMD = $(PYTHON) -I labkit/runtime/cudadriver.py --cpu-index $(CPU_INDEX)
# What `make lab` can do on this OS (docs/self-study.md; macOS and WSL2 are untested here): Linux and WSL2
# everything, macOS the labs on the CPU without DeepSpeed's CPU ops, native Windows nothing (use WSL2).
UNAME_S := $(shell uname -s 2>/dev/null || echo Windows)
NATIVE_WINDOWS := $(filter MINGW% MSYS% CYGWIN% Windows%,$(UNAME_S))
MACOS := $(filter Darwin,$(UNAME_S))
WSL := $(if $(MACOS)$(NATIVE_WINDOWS),,$(shell grep -qi microsoft /proc/sys/kernel/osrelease 2>/dev/null && echo yes))
WINDOWS_NOTE = error: native Windows ($(UNAME_S)) cannot run the labs (torchrun's gloo ranks, DeepSpeed, bubblewrap): install WSL2 and run make lab inside it (docs/self-study.md)
MACOS_NOTE = macOS (untested): the labs run on the CPU in PROFILE = \"smoke\"; not here: DeepSpeed's CPU ops (lab 05 and lab 08's ZeRO runs: use Linux, WSL2 or Kaggle), CUDA profiles, labkit grade --execute (bubblewrap is Linux-only); docs/self-study.md
WSL_NOTE = WSL2 (untested): as on Linux; a GPU through Windows' NVIDIA driver runs the 1-GPU profiles, several GPUs (NCCL under WSL2) are unverified; docs/self-study.md
# DeepSpeed JIT-builds its C++ ops on first use; keep that cache inside the repo's ignored build dir.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(BUILD)/torch_extensions
export MPLBACKEND := Agg
PYTEST_ARGS ?=

.PHONY: gpu-check gpu-check-wheels lab torch-index test ds-ops test-fast test-changed test-profile smoke rehearse venv lock kernel clean-notebooks clean bench slides chromium bubblewrap student site site-deps

$(BIN)/.installed: pyproject.toml $(LOCK)
	@if [ -n "$(NATIVE_WINDOWS)" ]; then echo "$(WINDOWS_NOTE)"; exit 1; fi
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=python3 ...'"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	index="$(TORCH_INDEX)"; if [ -z "$$index" ]; then index=$$($(TORCH_INDEX_CMD)) || exit 1; fi; \
	from=$${index:+--index-url $$index --extra-index-url https://pypi.org/simple}; \
	$(BIN)/python -m pip install -c $(LOCK) $$from $(TORCH_PINS) && \
	$(BIN)/python -m pip install -c $(LOCK) $$from $(TORCH_PINS) -e '.[test]'
	$(BIN)/python -m ipykernel install --sys-prefix --name labkit --display-name "labkit (Python 3)"
	touch $@

venv: $(BIN)/.installed

# The wheel index `make venv` would install torch from on this machine ('' = PyPI's), and on stderr why.
torch-index:
	@$(TORCH_INDEX_CMD)

# DeepSpeed's CPU ops (shm_comm, cpu_adam: minutes of C++ on 2 cores), built once into TORCH_EXTENSIONS_DIR
# instead of by the first DeepSpeed run while the others wait on its lock (labkit/parallel/ds_ops.py). On a
# GPU node it builds nothing: DeepSpeed builds its CUDA ops on first use.
DS_OPS := $(BUILD)/torch_extensions/.labkit-ds-ops
$(DS_OPS): $(BIN)/.installed
	mkdir -p $(@D)
	$(BIN)/python -m labkit.parallel.ds_ops
	touch $@

ds-ops: $(DS_OPS)

# Rewrite the lock from the venv: after pyproject.toml gained a package (the venv installs it first),
# or with UPGRADE=1 at the start of a semester (the newest releases pyproject.toml's bounds allow;
# run `make test` on the result before the class uses it). A class keeps one lock all term.
UPGRADE ?=
lock: venv
	$(if $(UPGRADE),$(BIN)/python -m pip install --upgrade --upgrade-strategy eager -e '.[test]')
	$(BIN)/python -m pip freeze | $(BIN)/python -m labkit.lockfile > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	touch $(BIN)/.installed

kernel: venv
	$(BIN)/python -m ipykernel install --sys-prefix --name labkit --display-name "labkit (Python 3)"

# LAB_ARGS passes options to JupyterLab, e.g. LAB_ARGS="--no-browser --port 8888" on a remote node.
LAB_ARGS ?=
lab: venv $(if $(MACOS),,ds-ops)
	@if [ -n "$(MACOS)" ]; then echo "$(MACOS_NOTE)"; fi
	@if [ -n "$(WSL)" ]; then echo "$(WSL_NOTE)"; fi
	$(BIN)/jupyter lab --notebook-dir=notebooks $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_ARGS)

# The whole suite on 2 pytest-xdist workers; tests/_schedule.py groups each file (and files sharing a fixture)
# and sends the heaviest first. PYTEST_ARGS="-n 0" runs it in one process. docs/DEVELOPING.md, "The suite".
XDIST ?= -n 2 --dist loadgroup --no-loadscope-reorder
test: venv ds-ops chromium bubblewrap site-deps
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
test-profile: venv ds-ops chromium bubblewrap site-deps
	mkdir -p $(BUILD)
	rm -f $(BUILD)/test-profile.jsonl
	$(BIN)/python -m pytest $(XDIST) --kind-profile $(BUILD)/test-profile.jsonl $(PYTEST_ARGS)

smoke: venv
	$(BIN)/labkit notebooks run --profile smoke --out $(BUILD)/executed

# The week before class, on any machine: every notebook as PROFILE's node runs it, on CPU (docs/gpu-node.md).
PROFILE ?= a100x4
# WARM=1: kernels forked from one that imported torch once, through the test suite's hook (tests/support/warmstart)
rehearse: venv ds-ops
	$(if $(filter 1,$(WARM)),LABKIT_TEST_HOOK=$(CURDIR)/tests/support:warmstart.hook LABKIT_WARM_KERNELS=1) \
	$(BIN)/labkit notebooks run --profile $(PROFILE) --rehearse --out $(BUILD)/rehearsed/$(PROFILE)

# The acceptance check for the first GPU (docs/gpu-node.md; labkit/course/gpu_check.py): under 8 minutes,
# build/gpu-check/report.{json,md}. Each check has its own cap (machine 25 s, wheels 5, node health 10,
# bitsandbytes 15, G1 35, memory 40, ResNet-50 AMP 25, LLM MFU 25, notebooks 00/01/06/02 20/30/55/85,
# preflight slice 80: 450 of 480 s) and runs in its own interpreter, killed at its cap (a fail naming it).
# Without a GPU it rehearses (GPU-only checks skipped, saying why); it runs in `make test`
# (tests/test_gpu_check.py). On a stock PyTorch CUDA image without our venv:
# `make gpu-check GPU_PY=python3` after `pip install --no-index build/gpu-check/wheels/*.whl`.
# When a GPU is at hand, commit build/gpu-check/report.md under docs/gpu-check/ (machine and date).
GPU_PY ?=
# GPU_CHECK_ARGS: --only g1,memory reruns those checks (the report keeps the others' lines); --budget S.
GPU_CHECK_ARGS ?=
gpu-check: $(if $(GPU_PY),,venv)
	$(or $(GPU_PY),$(BIN)/python) scripts/gpu_check.py --out $(BUILD)/gpu-check $(GPU_CHECK_ARGS)

# The wheels gpu-check needs beyond a stock PyTorch CUDA image (labkit.course.gpu_check.WHEELS), downloaded
# here (network) for the GPU machine (none): pinned by the lock, no dependencies (the image has them).
gpu-check-wheels: venv
	mkdir -p $(BUILD)/gpu-check/wheels
	$(BIN)/python -m pip wheel --no-deps -w $(BUILD)/gpu-check/wheels \
	  $$($(BIN)/python -c "from labkit.course.gpu_check import pinned_wheels; print(*pinned_wheels('$(LOCK)'))")
	du -sh $(BUILD)/gpu-check/wheels

bench: venv
	for f in bench/*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

# Slides are rendered and checked in Debian's headless Chromium (tests/test_slides.py too).
chromium:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update && apt-get install -y chromium; \
	  else echo "error: /usr/bin/chromium is missing: run 'sudo apt-get install -y chromium' (Debian/Ubuntu), then retry"; exit 1; fi; \
	fi

# `labkit grade --execute` runs each notebook in Debian's bubblewrap sandbox (tests/test_grading_isolation.py);
# the Gradescope container rehearsal (tests/test_grading_container.py) loads libseccomp2 through pyseccomp.
bubblewrap:
	@if [ ! -x /usr/bin/bwrap ] || { ! ls /usr/lib/*/libseccomp.so.2 && ! ls /lib/*/libseccomp.so.2; } >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update && apt-get install -y bubblewrap libseccomp2; \
	  else echo "error: bubblewrap or libseccomp2 is missing: run 'sudo apt-get install -y bubblewrap libseccomp2' (Debian/Ubuntu), then retry"; exit 1; fi; \
	fi

# A self-study learner's own copy of the labs (docs/self-study.md): never replaces a file already in my-labs/.
student: venv
	$(BIN)/labkit assign --self-study --out my-labs

# The course website (docs/self-study.md): Jupyter Book 2 (the `site` extra) parses the pages on Debian's Node.js
# (no npm, no download: labkit renders the HTML itself, labkit.course.site).
site-deps: venv
	@if ! command -v node >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update && apt-get install -y nodejs; \
	  else echo "error: node is missing: run 'sudo apt-get install -y nodejs' (Debian/Ubuntu), then retry"; exit 1; fi; \
	fi
	@test -x $(BIN)/jupyter-book || $(BIN)/python -m pip install -c $(LOCK) -e '.[site]'

# SITE_REPO=https://github.com/OWNER/NAME points the labs' Open in Colab / Kaggle links there (default: site/site.yml).
SITE_REPO ?=
site: site-deps
	$(BIN)/labkit site build --out $(BUILD)/site $(if $(SITE_REPO),--repo $(SITE_REPO))

slides: venv chromium
	$(BIN)/labkit slides build --out $(BUILD)/slides

clean-notebooks: venv
	$(BIN)/labkit notebooks clean notebooks/*.ipynb reservations/*.ipynb

clean:
	rm -rf $(BUILD) .pytest_cache
