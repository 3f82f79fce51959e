"""A GPU profile's exercise ranks never fork from a forkserver that may have touched CUDA (issue 38, G1).

04's checks restart the kernel's forkserver with transformers' Llama preloaded; torchao's import then calls
torch.cuda.is_available(), which initialises CUDA there unless PYTORCH_NVML_BASED_CUDA_CHECK=1, and every
rank forked from it fails at `set_device` (pytorch#17357). tests/_cuda_poison.py makes the forkserver's CUDA
refuse to initialise; a GPU profile's rank must not meet that refusal (it is a fresh interpreter: it fails
on this CPU machine for want of a GPU, and only for that), while a CPU rank still forks.
"""
from __future__ import annotations

import importlib

import pytest

from labkit.course.exercises.cases import ExerciseError

sp = importlib.import_module("labkit.course.exercises.spawn")  # the package exports the function `spawn`

pytestmark = pytest.mark.slow  # starts a forkserver and ranks

POISON = ("_cuda_poison",)
REFUSAL = "CUDA was initialised in the forkserver"


def _cuda_rank(rank, world):
    import torch

    torch.cuda.set_device(rank)


def _cpu_rank(rank, world):
    import torch

    return getattr(torch.cuda, "labkit_forkserver_nvml_check", None)


def _gpu_spawn_error() -> str:
    with pytest.raises(ExerciseError) as caught:
        sp.spawn(_cuda_rank, world=1, profile="h100x1", imports=POISON, timeout=120)
    return str(caught.value) + str(caught.value.traceback or "")


def test_gpu_ranks_start_fresh_cpu_ranks_fork(monkeypatch):
    with sp.warm_ranks():
        # a CPU rank forks from the poisoned forkserver, which ran with torch's NVML check on
        assert sp.spawn(_cpu_rank, world=1, imports=POISON) == ["1"]
        assert REFUSAL not in _gpu_spawn_error()  # fresh interpreter: no GPU here, but no bad fork
        monkeypatch.setattr(sp, "_may_fork", lambda profile: True)  # what spawn did before: the test can fail
        assert REFUSAL in _gpu_spawn_error()


def test_every_rank_gets_the_nvml_check():
    assert sp._child_env(0, 1, 29500)["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    assert not sp._may_fork("h100x1") and sp._may_fork("smoke")
