"""`--memory-cap-gb CAP`: train as if the device had only CAP GB (a smaller GPU on a bigger one).

The scenario of notebook 06 -- Llama-2-7B on one 24 GB RTX 4090 -- runs for real on an 80 GB A100:
`torch.cuda.set_per_process_memory_fraction(CAP / total)` makes PyTorch's caching allocator raise
`torch.cuda.OutOfMemoryError` as soon as this process would hold more than CAP GB, so the full fine-
tune fails where the 4090 would and LoRA / QLoRA fit. On CPU nothing runs out of memory, so the same
cap is enforced against the tracked peak of one training step (`metrics.PeakMemory`: MemTracker
tensor accounting, the number every record's `peak_bytes` shows): a run whose peak exceeds the cap
raises `MemoryCapExceeded`, which *is* a `torch.cuda.OutOfMemoryError`, so code that handles a real
OOM (the notebook's walk, the batch finder) handles it the same way. GB = 10^9 bytes, like the
profiles' `gpu_memory_gb`. Introduced in notebook 06_peft.
"""
from __future__ import annotations

import contextlib

import torch

from labkit.runtime import allocator
from labkit.runtime import device as devices
from labkit.errors import LabkitError

GB = 10 ** 9


class MemoryCapExceeded(LabkitError, torch.OutOfMemoryError):
    """The tracked peak of a step exceeded `--memory-cap-gb` (the CPU stand-in for a CUDA OOM)."""


def cap_bytes(cap_gb: float | None) -> int | None:
    """The cap in bytes (TrainConfig validated it: > 0), None without a cap."""
    return None if cap_gb is None else int(cap_gb * GB)


def fraction_of(cap: int, total: int) -> float:
    """The allocator fraction for a cap on a device of `total` bytes (at most 1: a cap above the device
    size changes nothing)."""
    return min(1.0, cap / total)


@contextlib.contextmanager
def applied(cap_gb: float | None, device: torch.device):
    """On CUDA: limit this process's allocator to the cap for the enclosed run, then lift the limit
    (a notebook runs uncapped runs after capped ones in the same process). On CPU: nothing to set;
    `check` enforces the cap after the tracked step."""
    cap = cap_bytes(cap_gb)
    if cap is None or not devices.is_gpu(device):
        yield
        return
    # Unverified on hardware (no GPU in CI): the fraction applies to this process's caching allocator
    # on `device` only; memory already cached above the cap is not returned, hence empty_cache first.
    total = devices.total_memory(device)
    allocator.empty_cache(device)
    allocator.set_memory_fraction(fraction_of(cap, total), device)
    try:
        yield
    finally:
        allocator.set_memory_fraction(1.0, device)


def check(cap_gb: float | None, peak_bytes: int, *, what: str = "one training step") -> None:
    """Raise MemoryCapExceeded when the tracked peak is above the cap (the CPU enforcement)."""
    cap = cap_bytes(cap_gb)
    if cap is not None and peak_bytes > cap:
        raise MemoryCapExceeded(
            f"out of memory under --memory-cap-gb {cap_gb:g}: {what} peaked at {peak_bytes / GB:.6g} GB "
            f"(tracked tensors) > the {cap_gb:g} GB cap; fit it with --strategy lora or qlora, "
            "--checkpointing, --optimizer adamw-8bit or a smaller --batch")


#: The scenario's GPU: an RTX 4090, 24 GiB = 24,564 MiB as nvidia-smi shows it -- the same capacity the
#: notebook's "fits in 24 GB" table uses (`labkit.memory.report.GPU_CAPACITIES`), so the cap the runs
#: train under and the table agree (issue #25, finding 10: a cap of 24 billion bytes against a 24 GiB table).
SCENARIO_GPU = "RTX 4090 24GB"
_ESTIMATOR_PRECISION = {"float32": ("fp32", "fp32"), "bfloat16": ("mixed-bf16", "bf16"),
                        "float16": ("mixed-fp16", "fp16")}


def scenario_cap_gb(profile, model: str) -> float:
    """Notebook 06's cap: 24 GB on a GPU profile, or the GPU's own memory where that is smaller (a 16 GB
    T4: a 24 GB cap there would read as if the card had 24). On CPU the same story scaled to `model`: the
    geometric mean of the estimates (labkit.memory) of a full fine-tune and of LoRA (r=8 on q,v) at the
    profile's batch, so the full fine-tune runs out of memory and LoRA fits, with margin on both sides."""
    if profile.device == "cuda":
        from labkit.memory.report import GPU_CAPACITIES
        return min(GPU_CAPACITIES[SCENARIO_GPU], profile.gpu_memory_gb * GB) / GB
    from labkit.memory.estimate import MemoryConfig, estimate

    full_precision, frozen_precision = _ESTIMATOR_PRECISION[profile.dtype]
    shape = dict(model=model, batch=profile.llm_batch, seq=profile.seq_len)
    full = estimate(MemoryConfig(**shape, precision=full_precision)).total
    lora = estimate(MemoryConfig(**shape, precision=frozen_precision, lora_rank=8, lora_targets=("q", "v"))).total
    return (full * lora) ** 0.5 / GB
