"""The GPU's clock and memory as a run measures them: `synchronize` and timing events, the CUDA caching
allocator (peaks, `empty_cache`, the per-process memory fraction, its summary), the allocator's history
(snapshots for pytorch.org/memory_viz) and the profiler's ranges (NVTX, `cudaProfilerApi`). Split out of
`labkit.runtime.device`, which says which device a rank computes on and holds its groups and meshes.

Each function takes the device a run computes on. In a rehearsal (`labkit.runtime.rehearsal`) the CPU
stands in for `cuda:r`: each function records what the node would do (`labkit.runtime.rehearsal.calls`)
and `max_memory_allocated` reports the estimate of the run at its real size (`simulate_peak`).

Unverified on hardware here (no GPU in CI): the CUDA side of each function is the documented torch
call, exercised on CPU only through the rehearsal's record. Introduced in notebook 02_single_gpu.
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Iterator

import torch

from labkit.runtime.device import is_gpu, logical, standing_in
from labkit.runtime.rehearsal import record

#: Bytes the stand-in allocator reports as the peak: the estimate of the run being rehearsed.
_SIMULATED_PEAK = 0


# ------------------------------------------------------------------------------------ the allocator
def _cuda_only(event: str, device: torch.device | str, call) -> None:
    """`call()` on a CUDA device; in a rehearsal record `event` for the GPU the CPU stands in for."""
    if standing_in() and is_gpu(device):
        record(event, device=logical(device))
    elif torch.device(device).type == "cuda":
        call()


def synchronize(device: torch.device | str) -> None:
    """Wait for the GPU's queued work (CUDA is asynchronous); nothing on CPU."""
    _cuda_only("synchronize", device, lambda: torch.cuda.synchronize(device))


def empty_cache(device: torch.device | str) -> None:
    """Hand the caching allocator's free blocks back to the driver."""
    _cuda_only("empty_cache", device, torch.cuda.empty_cache)


def reset_peak(device: torch.device | str) -> None:
    """Restart `max_memory_allocated` from the current allocation."""
    _cuda_only("reset_peak_memory_stats", device, lambda: torch.cuda.reset_peak_memory_stats(device))


def max_memory_allocated(device: torch.device | str) -> int:
    """The allocator's peak bytes; rehearsal: the estimate of the run at its real size (not a measurement)."""
    if standing_in() and is_gpu(device):
        record("max_memory_allocated", device=logical(device))
        return _SIMULATED_PEAK
    return int(torch.cuda.max_memory_allocated(device)) if torch.device(device).type == "cuda" else 0


def memory_allocated(device: torch.device | str) -> int:
    if standing_in() and is_gpu(device):
        return 0
    return int(torch.cuda.memory_allocated(device)) if torch.device(device).type == "cuda" else 0


def simulate_peak(nbytes: int) -> None:
    """Rehearsal: the bytes `max_memory_allocated` reports for the run about to execute."""
    global _SIMULATED_PEAK
    _SIMULATED_PEAK = int(nbytes)


def memory_summary(device: torch.device | str) -> str:
    """`torch.cuda.memory_summary` (abbreviated)."""
    if standing_in() and is_gpu(device):
        record("memory_summary", device=logical(device))
        return f"(rehearsal: the CUDA allocator's summary of {logical(device)} prints here on the node)"
    return torch.cuda.memory_summary(device, abbreviated=True)

def set_memory_fraction(fraction: float, device: torch.device | str) -> None:
    """`torch.cuda.set_per_process_memory_fraction`: this process's allocator may hold `fraction` of the GPU."""
    if standing_in() and is_gpu(device):
        record("set_per_process_memory_fraction", device=logical(device), fraction=round(fraction, 6))
    else:
        torch.cuda.set_per_process_memory_fraction(fraction, device)

class _RehearsalEvent:
    """CUDA event stand-in: the perf_counter time of `record()`, `elapsed_time` in ms like CUDA's."""

    def __init__(self):
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: "_RehearsalEvent") -> float:
        return (other.t - self.t) * 1e3


def timing_event():
    """A timing CUDA event (`torch.cuda.Event(enable_timing=True)`) of the current stream."""
    if standing_in():
        return _RehearsalEvent()
    return torch.cuda.Event(enable_timing=True)


# ------------------------------------------------------------------------------------ profiling
@contextlib.contextmanager
def memory_history(device: torch.device | str, snapshot: str | os.PathLike | None, *,
                   max_entries: int = 100_000) -> Iterator[None]:
    """Record the CUDA allocator's history (a stack per allocation) for the enclosed work, write it to
    `snapshot` (drag it onto pytorch.org/memory_viz; None = do not write) and ALWAYS switch recording
    off again, also when the work raised (the private `torch.cuda.memory._record_memory_history` API)."""
    if not is_gpu(device):
        yield
        return
    if standing_in():
        record("record_memory_history", device=logical(device), snapshot=str(snapshot))
        try:
            yield
        finally:
            if snapshot is not None:
                _placeholder_snapshot(Path(snapshot))
        return
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        yield
        if snapshot is not None:
            Path(snapshot).parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(snapshot))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _placeholder_snapshot(path: Path) -> None:
    import pickle
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps({"rehearsal": True, "note": "no CUDA allocator here: not a snapshot"}))


def start_history(device, max_entries: int = 100_000) -> None:
    """The profiler's half of `memory_history` (its window opens and closes in different calls)."""
    if standing_in():
        record("record_memory_history", device=logical(device))
    else:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)


def stop_history(device, snapshot: str | os.PathLike | None) -> None:
    if standing_in():
        if snapshot is not None:
            _placeholder_snapshot(Path(snapshot))
        record("record_memory_history_off", device=logical(device))
        return
    try:
        if snapshot is not None:
            torch.cuda.memory._dump_snapshot(str(snapshot))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def nvtx_push(name: str) -> None:
    if not standing_in():
        torch.cuda.nvtx.range_push(name)


def nvtx_pop() -> None:
    if not standing_in():
        torch.cuda.nvtx.range_pop()


def cuda_profiler(start: bool) -> None:
    """`torch.cuda.profiler.start/stop` (the range `nsys --capture-range=cudaProfilerApi` records)."""
    if standing_in():
        record("cuda_profiler", start=start)
    elif start:
        torch.cuda.profiler.start()
    else:
        torch.cuda.profiler.stop()
