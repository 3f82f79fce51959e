"""Preloaded by a test's forkserver (tests/test_spawn_fork.py): a preload that initialised CUDA, as torchao's
import does through torch.cuda.is_available() (issue 38, G1). On a CPU machine CUDA cannot be initialised,
so this stands in for it: the forkserver's torch.cuda refuses to initialise, as a bad fork's does."""
import os

import torch.cuda


def _refuse(*args, **kwargs):
    raise RuntimeError("CUDA initialization error: CUDA was initialised in the forkserver before this fork")


torch.cuda._lazy_init = _refuse
torch.cuda.labkit_forkserver_nvml_check = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK", "")
