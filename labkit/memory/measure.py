"""Measure one real training step on the current device.

Same step as `labkit.memory.dry_run` (same model, optimizer and mixed-precision scheme), but with real
tensors: on a GPU the total is the CUDA caching allocator's peak (`torch.cuda.max_memory_allocated`,
what `nvidia-smi` shows minus the context and cached-but-free blocks); on CPU, where that counter
silently returns 0, MemTracker's tensor accounting is the measurement. The per-part split always
comes from MemTracker. Introduced in notebook 01_memory.
"""
from __future__ import annotations

import time

import torch

from labkit.runtime import allocator
from labkit.runtime import device as devices
from labkit.errors import ConfigError
from labkit.memory.estimate import Estimate, MemoryConfig, estimate
from labkit.memory.dry_run import _quiet, check_traceable, run_step, to_estimate

#: Refuse a CPU measurement that would need more than this share of the free RAM.
RAM_SHARE = 0.5


def default_device() -> str:
    return "cuda" if devices.cuda_present() else "cpu"


def _check_ram(cfg: MemoryConfig) -> None:
    import psutil

    need = estimate(cfg).total
    free = psutil.virtual_memory().available
    if need > RAM_SHARE * free:
        raise ConfigError(f"measuring {cfg.model} allocates for real: ~{need / 1e9:.1f} GB needed, "
                          f"{free / 1e9:.1f} GB of RAM free; use `labkit memory trace` (fake tensors) "
                          "or a smaller model such as tiny-llama")


class CudaPeak:
    """The CUDA caching allocator's peak over one step, counted from the moment the model is built
    and cast (`built()`), so a transient copy made while building is not in it; the bytes allocated
    before the build (`start()`) are not counted either. Unverified on hardware here: tested on CPU
    with stand-ins for the torch.cuda calls (documented semantics: reset_peak_memory_stats restarts
    max_memory_allocated from the current allocation)."""

    def __init__(self, device: str):
        self.device, self.base = device, 0

    def start(self) -> None:
        allocator.synchronize(self.device)
        self.base = allocator.memory_allocated(self.device)

    def built(self) -> None:
        allocator.synchronize(self.device)
        allocator.reset_peak(self.device)

    def total(self) -> int:
        allocator.synchronize(self.device)
        return allocator.max_memory_allocated(self.device) - self.base


def measure(cfg: MemoryConfig, *, device: str | None = None) -> Estimate:
    """One real forward/backward/optimizer step of `cfg` on `device` (default: CUDA if present).
    The device's memory is handed back at the end (garbage collected, CUDA cache emptied)."""
    from labkit.train.metrics import free_device_memory

    device = str(devices.resolve(device or default_device()))  # a rehearsal's "cuda" is its CPU stand-in
    check_traceable(cfg)
    if not devices.is_gpu(device):
        _check_ram(cfg)
    start = time.perf_counter()
    peak = CudaPeak(device) if devices.is_gpu(device) else None
    if peak is not None:
        peak.start()
    try:
        with _quiet():
            current, peaks, n, trainable = run_step(cfg, device=device, on_built=peak.built if peak else None)
        notes = [f"measured one real step of {cfg.model} on {device} in {time.perf_counter() - start:.1f} s"]
        if peak is not None:
            peaks["Total"] = peak.total()
            notes.append("total = CUDA allocator peak (max_memory_allocated) from the built, cast model on; "
                         "parts from MemTracker")
        else:
            notes.append("total = MemTracker peak of live tensors (the CUDA counters read 0 on CPU)")
    finally:
        free_device_memory(device)
    return to_estimate(cfg, current, peaks, n, trainable, "measure", notes)
