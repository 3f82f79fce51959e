"""Measure one real training step on the current device.

Same step as `labkit.memory.trace` (same model, optimizer and mixed-precision scheme), but with real
tensors: on a GPU the total is the CUDA caching allocator's peak (`torch.cuda.max_memory_allocated`,
what `nvidia-smi` shows minus the context and cached-but-free blocks); on CPU, where that counter
silently returns 0, MemTracker's tensor accounting is the measurement. The per-part split always
comes from MemTracker. Introduced in notebook 01_memory.
"""
from __future__ import annotations

import time

import torch

from labkit.errors import ConfigError
from labkit.memory.estimate import Estimate, MemoryConfig, estimate
from labkit.memory.trace import _quiet, check_traceable, run_step, to_estimate

#: Refuse a CPU measurement that would need more than this share of the free RAM.
RAM_SHARE = 0.5


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_ram(cfg: MemoryConfig) -> None:
    import psutil

    need = estimate(cfg).total
    free = psutil.virtual_memory().available
    if need > RAM_SHARE * free:
        raise ConfigError(f"measuring {cfg.model} allocates for real: ~{need / 1e9:.1f} GB needed, "
                          f"{free / 1e9:.1f} GB of RAM free; use `labkit memory trace` (fake tensors) "
                          "or a smaller model such as tiny-llama")


def measure(cfg: MemoryConfig, *, device: str | None = None) -> Estimate:
    """One real forward/backward/optimizer step of `cfg` on `device` (default: CUDA if present)."""
    device = device or default_device()
    check_traceable(cfg)
    if device == "cpu":
        _check_ram(cfg)
    start = time.perf_counter()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with _quiet():
        current, peaks, n, trainable = run_step(cfg, device=device)
    notes = [f"measured one real step of {cfg.model} on {device} in {time.perf_counter() - start:.1f} s"]
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        peaks["Total"] = torch.cuda.max_memory_allocated(device) - base
        notes.append("total = CUDA allocator peak (max_memory_allocated); parts from MemTracker")
    else:
        notes.append("total = MemTracker peak of live tensors (the CUDA counters read 0 on CPU)")
    return to_estimate(cfg, current, peaks, n, trainable, "measure", notes)
