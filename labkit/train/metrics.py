"""Measurements of a run: step time, throughput, memory per rank, FLOPs and MFU.

Timing is never skewed by measurement: peak memory (CPU) and FLOPs are measured inside warm-up steps,
which the median step time excludes. Introduced in notebook 02_single_gpu.
"""
from __future__ import annotations

import contextlib
import gc
import statistics
from typing import NamedTuple

import torch

from labkit.runtime import allocator
from labkit.runtime import device as devices
from labkit.errors import ConfigError

#: Dense peak TFLOPS per GPU (no 2:4 sparsity) by (name fragment, compute dtype), from the vendors' data
#: sheets; the most specific fragment first (torch.cuda.get_device_name: "NVIDIA H100 PCIe",
#: "NVIDIA H100 80GB HBM3" = SXM5, "Tesla V100-PCIE-32GB"). "float32" is true FP32 on the CUDA cores:
#: labkit leaves TF32 matmuls off (torch's default, float32_matmul_precision "highest"), so an fp32 run
#: is measured against 19.5 (A100) / 67 (H100 SXM), not the TF32 tensor-core peak ("tf32").
PEAK_TFLOPS = (
    ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "tf32": 378.0, "float32": 51.0}),
    ("H100 NVL", {"bfloat16": 835.0, "float16": 835.0, "tf32": 418.0, "float32": 60.0}),
    ("H100", {"bfloat16": 989.0, "float16": 989.0, "tf32": 494.7, "float32": 67.0}),
    ("H200", {"bfloat16": 989.0, "float16": 989.0, "tf32": 494.7, "float32": 67.0}),  # H100's compute, more HBM
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5}),
    ("V100-PCIE", {"float16": 112.0, "float32": 14.0}),
    ("V100", {"float16": 125.0, "float32": 15.7}),
    # Turing (Colab's and Kaggle's free GPU): fp16 tensor cores 65, no bf16 (docs/free-gpus.md)
    ("T4", {"float16": 65.0, "float32": 8.1}),
)


class ResidentBytes(NamedTuple):
    """Bytes of model state resident on one rank's device, plus bytes a strategy moved to host."""

    param: int
    grad: int
    optimizer: int
    cpu_offload: int = 0


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank really holds), a plain tensor as is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _plain(tensors):
    """The plain tensors holding `tensors`' data: DTensors by local shard, wrapper subclasses (torchao's
    8-/4-bit optimizer states, which have no storage of their own) by their inner tensors."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = _local(t)
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            yield from _plain(getattr(t, name) for name in names)
        else:
            yield t


def tensor_bytes(tensors, device: torch.device) -> tuple[int, int]:
    """(bytes on `device`, bytes elsewhere) of `tensors`, each storage counted once."""
    seen, here, away = set(), 0, 0
    for t in _plain(tensors):
        key = (t.device, t.untyped_storage().data_ptr())
        if key in seen or t.device.type == "meta":
            continue
        seen.add(key)
        size = t.untyped_storage().nbytes()
        if t.device.type == device.type:
            here += size
        else:
            away += size
    return here, away


def resident_bytes(model: torch.nn.Module, optimizer, device: torch.device) -> ResidentBytes:
    """Params, grads and optimizer state of `model`/`optimizer` on `device` (DTensors by local shard)."""
    params = list(model.parameters())
    p_here, p_away = tensor_bytes(params, device)
    g_here, g_away = tensor_bytes([p.grad for p in params if p.grad is not None], device)
    states = [v for s in (optimizer.state.values() if optimizer else []) for v in s.values()]
    o_here, o_away = tensor_bytes(states, device)
    offload = (p_away + g_away + o_away) if devices.is_gpu(device) else 0
    return ResidentBytes(p_here, g_here, o_here, offload)


def free_device_memory(device: torch.device | str | None = None, *, reset_peak: bool = False) -> None:
    """Hand memory back: collect unreachable objects (a finished run's model, optimizer and the
    reference cycles autograd and hooks leave), then on CUDA return the caching allocator's free
    blocks to the driver (`torch.cuda.empty_cache`: what nvidia-smi and the next process see) and,
    with `reset_peak`, restart `max_memory_allocated` so the next measurement sees only its own peak.
    On CPU only the collection does anything. Unverified on hardware here: the CUDA calls are
    documented torch.cuda memory-management APIs, tested on CPU with stand-ins.

    The full collection (every generation) runs where memory is a GPU's: a finished run's cyclic garbage
    holds device memory the allocator cannot hand back. It walks the whole heap -- 0.3-1.5 CPU s in a
    process that imported torch, dynamo and transformers, most of a rehearsal's max-batch probe -- so on
    CPU (smoke, and a rehearsal's stand-in for cuda:r) only the young generations are collected: a probe's
    and a step's garbage; older cycles go at the interpreter's own next full collection."""
    device = torch.device(device) if device is not None else devices.default()
    gc.collect(2 if devices.is_gpu(device) and not devices.standing_in() else 1)
    if devices.is_gpu(device):
        allocator.synchronize(device)
        allocator.empty_cache(device)
        if reset_peak:
            allocator.reset_peak(device)


class PeakMemory:
    """Peak bytes of one rank: the CUDA allocator's high-water mark, or on CPU a MemTracker
    (torch.distributed._tools.mem_tracker) over one warm-up step -- tensor accounting, not RSS."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0
        if devices.is_gpu(device):
            allocator.reset_peak(device)

    @contextlib.contextmanager
    def track(self, model: torch.nn.Module, optimizer):
        """Context yielding `wrap(loss_fn)`: use the wrapped loss function inside the tracked step."""
        if devices.is_gpu(self.device):
            yield lambda loss_fn: loss_fn
            return
        # The memory lab's tracker: device-level peaks only (fast), and safe with frozen parameters
        # (torch's MemTracker raises when hooking the gradient of a LoRA / QLoRA base weight).
        from labkit.memory.dry_run import PeakTracker

        tracker = PeakTracker()
        # Strategies may own foreign optimizers (DeepSpeed's); MemTracker accepts torch ones only and
        # then sees the foreign state as it is allocated or touched inside the step.
        tracker.track_external(model, *([optimizer] if isinstance(optimizer, torch.optim.Optimizer) else []))

        def wrap(loss_fn):
            # MemTracker refuses a second forward of the same module (accumulation micro-batches)
            # unless its per-module stats are reset first; the device-wide peak is kept.
            def tracked(*args):
                tracker.reset_mod_stats()
                return loss_fn(*args)
            return tracked

        with tracker:
            yield wrap
        snap = tracker.get_tracker_snapshot("peak")
        self.peak = max(self.peak, sum(d.get("Total", 0) for d in snap.values()))

    def result(self) -> int:
        if devices.is_gpu(self.device):
            return allocator.max_memory_allocated(self.device)
        return int(self.peak)


def uncompiled_step_flops(module: torch.nn.Module, inputs: list) -> float:
    """FLOPs of one training step over the micro-batch `inputs`, counted on the module torch.compile
    wrapped (FlopCounterMode sees no aten ops inside a compiled graph: a compiled run reported MFU 0).

    3 x the forward FLOPs: backward costs 2 x forward for matmuls and convolutions (Kaplan et al.
    2020, 2N forward + 4N backward); the first layer's unneeded input gradient makes it an upper
    bound by a few percent. The forward runs in eval mode under no_grad (BatchNorm statistics and
    gradients stay untouched)."""
    from torch.utils.flop_counter import FlopCounterMode

    for attr in ("_orig_mod", "module"):  # torch.compile, DDP
        module = getattr(module, attr, module)
    was_training = module.training
    module.eval()
    counter = FlopCounterMode(display=False)
    try:
        with torch.no_grad(), counter:
            for x in inputs:
                module(x)
    finally:
        module.train(was_training)
    return 3.0 * counter.get_total_flops()


@contextlib.contextmanager
def count_flops(into: list):
    """Count the FLOPs of the enclosed work with torch.utils.flop_counter; appends the total to `into`."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        yield
    into.append(counter.get_total_flops())


def median_step_time(times: list[float], skip: set[int], warmup: int) -> float:
    """Median of per-step times (wall or CPU), without warm-up steps and steps that carried a measurement."""
    kept = [t for i, t in enumerate(times) if i >= warmup and i not in skip]
    if not kept:  # very short runs: everything but measured steps, else everything
        kept = [t for i, t in enumerate(times) if i not in skip] or times
    return statistics.median(kept) if kept else 0.0


@contextlib.contextmanager
def intra_op_threads(n: int):
    """torch's intra-op threads set to `n` inside the block, restored after: `--threads N` for a run in
    this process, as OMP_NUM_THREADS=N is for a launched rank, so a 1-rank run and the ranks of an N-rank
    run compute with the same threads each (a scaling ladder that gave the 1-rank run both cores of a
    2-core machine measured threads, not ranks)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(n)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------ scaling: wall clock and work
#: A scaling efficiency above this is no parallel speed-up but a measurement artefact: the 1-rank
#: run was slowed by something the N ranks were not (other processes on a shared CPU, a colder
#: cache, more threads), or the smaller per-rank batch ran faster per sample (cache effects).
EFFICIENCY_ARTEFACT = 1.05


def cpu_share(record) -> list[float]:
    """Per rank: CPU-seconds of a step / its wall-clock seconds (medians). About 1 for a rank that had
    a core to itself (one intra-op thread; gloo's threads add a little); well below 1 when other
    processes took the core (a shared machine), so the wall clock measured them too. [] if unknown."""
    cpu = record.train.cpu_step_time_s if record.train else []
    return [c / record.step_time_s for c in cpu] if cpu and record.step_time_s else []


def cpu_seconds_per_sample(record) -> float | None:
    """CPU-seconds all ranks together spent per training sample (medians of steady steps), or None
    for a record without CPU times. Other processes do not change it, unlike the wall clock."""
    cpu = record.train.cpu_step_time_s if record.train else []
    return sum(cpu) / record.global_batch if cpu and record.global_batch else None


def wall_efficiency(base, record) -> float:
    """Speedup per rank on the wall clock: (samples/s of `record` / samples/s of `base`) / (ranks ratio)."""
    if not base.samples_per_s:
        raise ConfigError(f"the {base.strategy} run has samples_per_s={base.samples_per_s!r}; re-run it")
    return record.samples_per_s / base.samples_per_s / (record.world_size / base.world_size)


def work_efficiency(base, record) -> float | None:
    """Share of the ranks' CPU work that was useful: CPU-seconds per sample of `base` (usually the
    1-rank run) / those of `record`, all ranks summed. 1 = the N ranks together did exactly the
    1-rank run's work; below 1 = communication, synchronization and smaller per-rank batches cost
    extra. None without CPU times. On CPU it is the efficiency a shared machine measures reliably;
    on a GPU the CPU mostly launches kernels and waits, so the wall clock is the measure there."""
    a, b = cpu_seconds_per_sample(base), cpu_seconds_per_sample(record)
    return a / b if a and b else None


def peak_for(gpu_name: str, dtype: str, *, tf32: bool = False, fallback: float = 0.0) -> float:
    """Dense peak TFLOPS of the GPU called `gpu_name` at `dtype` ("float32" means TF32 if `tf32`);
    the first matching fragment of PEAK_TFLOPS decides, `fallback` for an unknown GPU or dtype
    (a V100 has no bf16 tensor cores: no bf16 peak)."""
    key = "tf32" if dtype == "float32" and tf32 else dtype
    for fragment, table in PEAK_TFLOPS:
        if fragment.lower() in gpu_name.lower():
            return table.get(key, fallback)
    return fallback


def tf32_enabled() -> bool:
    """True if fp32 matmuls or cuDNN convolutions may run as TF32 (`labkit.runtime.device.tf32_enabled`)."""
    return devices.tf32_enabled()


def peak_tflops(device: torch.device, dtype: str, fallback: float = 0.0) -> float:
    """Dense peak TFLOPS of this GPU at `dtype` (0 on CPU: MFU is not defined there).
    Unverified on hardware: the device names the SKU table matches are from NVIDIA's naming, not read
    from our nodes; `labkit preflight` prints `device_name` so a mismatch shows up as MFU 0."""
    if not devices.is_gpu(device):
        return 0.0
    return peak_for(devices.device_name(device), dtype, tf32=tf32_enabled(), fallback=fallback)


def device_name(device: torch.device) -> str:
    return devices.device_name(device)


def mfu(flops_per_step: float, step_time_s: float, world_size: int, peak: float) -> float:
    """Model FLOPs utilization (Chowdhery et al. 2022, PaLM, App. B): achieved / (ranks x peak)."""
    if not (flops_per_step and step_time_s and peak):
        return 0.0
    return flops_per_step / step_time_s / (world_size * peak * 1e12)
