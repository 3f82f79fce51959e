# labkit for the course's GPU nodes (4x A100 80GB, 1x A100, H100, 4x V100): what environment.yml
# installs (the class's lock, requirements/lock.txt) on an official PyTorch CUDA image, plus the
# `labkit` Jupyter kernel. torch 2.14.1+cu126 (the locked version; runs on V100, A100 and H100)
# replaces the image's own.
# Build from the repository root and run (see containers/README.md):
#
#   docker build -t labkit:gpu .
#   docker run --gpus all --ipc=host -p 8888:8888 -v "$PWD/runs:/opt/labkit/runs" labkit:gpu
#
# tests/test_containers.py checks that this file installs what environment.yml and the lock say.

# The devel variant ships nvcc and the CUDA headers (environment.yml: cuda-nvcc, cuda-cudart-dev):
# DeepSpeed JIT-compiles FusedAdam / CPU Adam with them on first use.
ARG BASE=pytorch/pytorch:2.6.0-cuda12.6-cudnn9-devel
FROM ${BASE}

# environment.yml pins python=3.11 and cuda-version=12.6; the base image must agree (checked at build).
ARG PYTHON_VERSION=3.11
ARG CUDA_VERSION=12.6
RUN python -c "import sys; v = '%d.%d' % sys.version_info[:2]; assert v == '${PYTHON_VERSION}', v" \
 && python -c "import torch; v = torch.version.cuda; assert v and v.startswith('${CUDA_VERSION}'), v" \
 && nvcc --version

ENV PIP_NO_CACHE_DIR=1 \
    MPLBACKEND=Agg \
    PYTHONUNBUFFERED=1

# The class's lock: every pip install below takes its versions from it.
WORKDIR /opt/labkit
COPY requirements/lock.txt requirements/lock.txt

# The locked torch (2.14.1) as PyTorch's CUDA 12.6 wheel: the only 2.14 build with Volta (sm_70)
# kernels besides sm_80 (A100) and sm_90 (H100), so one image serves every course node (environment.yml
# pins the same). It replaces the base image's torch; every later pip install keeps it (constraint).
RUN pip install -c requirements/lock.txt --index-url https://download.pytorch.org/whl/cu126 --extra-index-url https://pypi.org/simple \
      "torch==2.14.1+cu126" "torchvision==0.29.1+cu126" \
 && python -c "import torch; assert torch.__version__ == '2.14.1+cu126' and torch.version.cuda.startswith('${CUDA_VERSION}'), torch.__version__" \
 && python -c "import torch, torchvision; print('torch==' + torch.__version__); print('torchvision==' + torchvision.__version__)" > /tmp/torch-constraint.txt

# The packages of pyproject.toml at their locked versions, in their own layer (a change to labkit's
# code does not reinstall them).
COPY pyproject.toml README.md environment.yml ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" > /tmp/deps.txt \
 && pip install -c requirements/lock.txt -c /tmp/torch-constraint.txt -r /tmp/deps.txt

# labkit itself (the `labkit` command) and the notebooks; no .venv, runs or build output.
COPY labkit ./labkit
COPY notebooks ./notebooks
RUN pip install -c requirements/lock.txt -c /tmp/torch-constraint.txt -e . \
 && python -m ipykernel install --sys-prefix --name labkit --display-name "labkit (Python 3)" \
 && labkit --help > /dev/null \
 && labkit env

# DeepSpeed's JIT-built ops go to a writable cache (the image may be read-only under Apptainer).
ENV TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
# Every lab's results (labkit.results.runs_root): the folder `docker run -v HOST:/opt/labkit/runs` mounts,
# so they outlive the container (containers/README.md); the notebooks' own folder is not mounted.
ENV LABKIT_RUNS=/opt/labkit/runs
EXPOSE 8888
CMD ["jupyter", "lab", "--ip=0.0.0.0", "--port=8888", "--no-browser", "--allow-root", "--notebook-dir=/opt/labkit/notebooks"]
