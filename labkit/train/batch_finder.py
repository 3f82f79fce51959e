"""How big a batch fits? The max-batch finder and a per-category memory breakdown of one step.

GPU: grow the micro-batch (doubling) until a step raises torch.cuda.OutOfMemoryError, then bisect
back between the last fit and the first failure. CPU has no out-of-memory to hit, so the same
search runs against a budget: a step "fits" when its tensor-accounted peak (MemTracker) stays under
`budget_mb` -- the lesson (memory grows linearly in the batch on top of the fixed model state) is the
same. Introduced in notebook 02_single_gpu.
"""
from __future__ import annotations

import gc
from typing import Callable

import torch

from labkit.errors import ConfigError

MiB = 2 ** 20


def search_max(fits: Callable[[int], bool], *, start: int = 1, limit: int = 4096) -> int:
    """Largest b in start..limit with fits(b), for a monotone `fits`: double until it fails, then bisect.

    Costs about 2 log2(answer / start) probes. Returns 0 when even b = start does not fit.
    """
    if not fits(start):
        return 0
    good, bad = start, None
    while good * 2 <= limit:
        if not fits(good * 2):
            bad = good * 2
            break
        good *= 2
    if bad is None:  # reached the limit without failing
        return good
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def _probe_hook(model: str, profile: str, **options):
    from labkit.parallel.single import SingleStrategy
    from labkit.train.api import make_config
    from labkit.train.data import make_task
    from labkit.train.worker import local_context

    cfg = make_config("single", model, profile=profile, **options)
    hook = SingleStrategy("single", local_context(cfg), cfg, make_task(cfg))
    hook.setup()
    return cfg, hook


def _fake_batch(task, cfg, b: int, device):
    """Random inputs of the right shape (memory does not depend on the values)."""
    if task.kind == "llm":
        tokens = torch.randint(task.num_classes, (b, cfg.seq_len + 1), device=device)
        return tokens[:, :-1], tokens[:, 1:]
    x = torch.randn(b, 3, cfg.image_size, cfg.image_size, device=device)
    if cfg.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, torch.randint(task.num_classes, (b,), device=device)


def _step_peak(hook, cfg, b: int) -> int | None:
    """Peak bytes of one training step at micro-batch b, or None on CUDA out-of-memory."""
    from labkit.train.metrics import PeakMemory

    device = hook.ctx.device
    peak = PeakMemory(device)
    try:
        batch = _fake_batch(hook.task, cfg, b, device)
        with peak.track(hook.model, hook.optimizer) as wrap:
            hook.train_step([batch], wrap(hook.task.loss))
        return peak.result()
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        batch = None
        hook.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def find_max_batch(model: str, *, profile: str = "smoke", budget_mb: float | None = None, limit: int = 4096,
                   **options) -> dict:
    """The largest micro-batch of `model` one device trains (AMP / checkpointing / channels_last via options).

    Returns {'max_micro_batch', 'budget_bytes', 'probes': [[batch, peak_bytes or None], ...], 'device'}.
    """
    cfg, hook = _probe_hook(model, profile, **options)
    device = hook.ctx.device
    if device.type == "cpu" and budget_mb is None:
        raise ConfigError("on CPU nothing runs out of memory: pass budget_mb (e.g. --memory-budget-mb 256) "
                          "to search against a budget, or run on a GPU profile")
    budget = int(budget_mb * MiB) if budget_mb else None
    probes: list[list] = []

    def fits(b: int) -> bool:
        peak = _step_peak(hook, cfg, b)
        probes.append([b, peak])
        return peak is not None and (budget is None or peak <= budget)

    # BatchNorm cannot normalise one sample per channel in training mode: image models start at 2.
    best = search_max(fits, start=2 if hook.task.kind == "vision" else 1, limit=limit)
    hook.close()
    return {"model": model, "max_micro_batch": best, "budget_bytes": budget, "probes": probes,
            "device": str(device), "amp": cfg.amp, "checkpointing": cfg.checkpointing}


def memory_breakdown(model: str, *, profile: str = "smoke", batch: int | None = None, **options) -> dict:
    """Bytes by kind (parameters, gradients, optimizer state, activations, temporaries) at the peak of one
    training step, from MemTracker (works on CPU and GPU); on GPU also `torch.cuda.memory_summary()`."""
    from torch.distributed._tools.mem_tracker import MemTracker

    cfg, hook = _probe_hook(model, profile, **options)
    x, y = _fake_batch(hook.task, cfg, batch or cfg.batch, hook.ctx.device)
    hook.train_step([(x, y)], hook.task.loss)  # first step creates the optimizer state
    tracker = MemTracker()
    tracker.track_external(hook.model, hook.optimizer)
    with tracker:
        hook.train_step([(x, y)], hook.task.loss)
    peak = tracker.get_tracker_snapshot("peak")
    out = {getattr(k, "value", str(k)): int(v) for snap in peak.values() for k, v in snap.items()}
    if hook.ctx.device.type == "cuda":
        out["cuda_memory_summary"] = torch.cuda.memory_summary(hook.ctx.device, abbreviated=True)
    hook.close()
    return out
