"""The training harness: one loop for every strategy, its config, data, metrics and checkpoints.

    from labkit.train import run
    record = run("single", "tiny-resnet", profile="smoke", steps=20)   # -> labkit.results.RunRecord

Submodules: `config` (TrainConfig), `api` (run), `loop` (the loop), `data`, `levers` (AMP,
activation checkpointing, channels_last, compile), `metrics`, `checkpoint`, `batch_finder`, `worker`
(the torchrun entry point), `many` (several runs in one torchrun launch: `run_many`). Attributes load
lazily, so importing this package does not import torch.
Introduced in notebook 02_single_gpu.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "TrainConfig": "config", "run": "api", "make_config": "api", "record_of": "api", "train": "loop",
    "find_max_batch": "batch_finder", "memory_breakdown": "batch_finder",
    "latest_checkpoint": "checkpoint", "Task": "data", "run_many": "many",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"labkit.train.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'labkit.train' has no attribute {name!r}")
