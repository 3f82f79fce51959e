"""How big a batch fits? The max-batch finder and a per-category memory breakdown of one step.

GPU: grow the micro-batch (doubling) until a step runs out of memory, then bisect back between the
last fit and the first failure. Out of memory is torch.cuda.OutOfMemoryError or one of the
RuntimeErrors cuBLAS / cuDNN raise when their own workspace allocation fails (`OOM_MESSAGES`). A
search that never failed up to `limit` says so (`limit_reached`): the answer is a lower bound.
CPU has no out-of-memory to hit, so the same search runs against a budget: a step "fits" when its
tensor-accounted peak (MemTracker) stays under `budget_mb` -- the lesson (memory grows linearly in
the batch on top of the fixed model state) is the same. Introduced in notebook 02_single_gpu.
"""
from __future__ import annotations

from typing import Callable

import torch

from labkit.runtime import allocator
from labkit.runtime import device as devices
from labkit.errors import ConfigError
from labkit.train.metrics import free_device_memory

MiB = 2 ** 20
#: A rehearsal's probe steps at most this micro-batch on its stand-in model (the node's allocator is
#: simulated from the estimator at the probed size; labkit.runtime.rehearsal).
REHEARSAL_BATCH = 2  # two samples: BatchNorm trains on no fewer
#: Probe cap: large enough that a ResNet-50 on an 80 GB GPU runs out of memory first (doubling makes
#: the cap cost one probe per factor of 2, and the first failure ends the growth).
DEFAULT_LIMIT = 1 << 16
#: RuntimeError texts that mean "the device ran out of memory" although they are not
#: torch.cuda.OutOfMemoryError: cuBLAS handle/workspace allocation ("CUBLAS_STATUS_ALLOC_FAILED"),
#: cuDNN workspace/allocation ("CUDNN_STATUS_NOT_ENOUGH_WORKSPACE", "CUDNN_STATUS_ALLOC_FAILED"),
#: and the generic "CUDA error: out of memory" of a failed cudaMalloc outside the caching allocator.
#: Unverified on hardware here: the texts are those the libraries' status names print, tested on CPU
#: with simulated errors.
OOM_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
                "CUDNN_STATUS_ALLOC_FAILED")
#: cuDNN status errors that mean out of memory while a probe is near the limit: cuDNN fails allocations
#: inside its kernels as INTERNAL_ERROR / EXECUTION_FAILED (pytorch#81620). Only probes count them (a
#: run's INTERNAL_ERROR elsewhere is a bug to see). Unverified on hardware here (issue 38, G3).
PROBE_OOM_MESSAGES = ("CUDNN_STATUS_INTERNAL_ERROR", "CUDNN_STATUS_EXECUTION_FAILED")
#: The share of the largest batch that fitted once which a later run uses (`safe_micro_batch`): the
#: probe's peak has no MemTracker, no new cuDNN workspaces and no fragmentation on top (issue 38, G3).
MARGIN = 0.75


def is_oom(exc: BaseException, *, probing: bool = False) -> bool:
    """True if `exc` means the device ran out of memory (OOM_MESSAGES; while `probing` also PROBE_OOM_MESSAGES)."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text, known = str(exc).lower(), OOM_MESSAGES + (PROBE_OOM_MESSAGES if probing else ())
    return isinstance(exc, RuntimeError) and any(m.lower() in text for m in known)


def safe_batch(largest: int, smallest: int = 1) -> int:
    """MARGIN of the largest micro-batch that fitted once, at least `smallest` (0 when nothing fitted)."""
    return max(smallest, int(largest * MARGIN)) if largest else 0


def search_max(fits: Callable[[int], bool], *, start: int = 1, limit: int = DEFAULT_LIMIT) -> int:
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

    from labkit.train import stand_in

    # The real config is what a rehearsal sizes (its batch and image size are the node's); the hook
    # executes its stand-in (the same config outside a rehearsal).
    cfg = make_config("single", model, profile=profile, rehearse_as=None, real=True, **options)
    small = stand_in.stand_in(cfg)
    hook = SingleStrategy("single", local_context(small), small, make_task(small))
    hook.setup()
    return cfg, hook


def _fake_batch(task, cfg, b: int, device):
    """Random inputs of the right shape (memory does not depend on the values)."""
    if task.kind == "llm":
        tokens = torch.randint(task.num_classes, (b, cfg.run.seq_len + 1), device=device)
        return tokens[:, :-1], tokens[:, 1:]
    x = torch.randn(b, 3, cfg.run.image_size, cfg.run.image_size, device=device)
    if cfg.precision.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, torch.randint(task.num_classes, (b,), device=device)


def _step_peak(hook, cfg, b: int) -> int | None:
    """Peak bytes of one training step at micro-batch b, or None when the device ran out of memory."""
    from labkit.train.metrics import PeakMemory

    from labkit.runtime import rehearsal
    from labkit.train import stand_in

    device = hook.ctx.device
    peak = PeakMemory(device)
    try:
        stand_in.simulate_oom(cfg.replace(batch=b))  # rehearsal: the node's allocator, from the estimator
        batch = _fake_batch(hook.task, hook.cfg, min(b, REHEARSAL_BATCH) if rehearsal.active() else b, device)
        with peak.track(hook.model, hook.optimizer) as wrap:
            hook.train_step([batch], wrap(hook.task.loss))
        return peak.result()
    except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
        if not is_oom(exc, probing=True):
            raise
        return None
    finally:
        batch = None
        hook.optimizer.zero_grad(set_to_none=True)
        free_device_memory(device)


def find_max_batch(model: str, *, profile: str = "smoke", budget_mb: float | None = None,
                   limit: int = DEFAULT_LIMIT, isolate: bool | None = None, **options) -> dict:
    """The largest micro-batch of `model` one device trains (AMP / checkpointing / channels_last via options).

    Returns {'max_micro_batch', 'safe_micro_batch' (MARGIN of it: what to run at), 'limit_reached',
    'budget_bytes', 'probes': [[batch, peak_bytes or None], ...], 'device', ...}. `limit_reached` is True
    when no probe up to `limit` failed: then 'max_micro_batch' is only a lower bound (raise `limit`).
    `isolate` (default: on a GPU, not in a rehearsal) probes in a fresh interpreter: the caller's process
    (a notebook's kernel) never holds a CUDA context an out-of-memory cuDNN error may have broken, nor
    the probes' cached blocks. The device memory is freed at the end.
    """
    if isolate is None:
        from labkit.runtime import rehearsal
        from labkit.profiles import get_profile

        isolate = get_profile(profile).device == "cuda" and not rehearsal.active()
    if isolate:
        return _isolated(dict(model=model, profile=profile, budget_mb=budget_mb, limit=limit, **options))
    cfg, hook = _probe_hook(model, profile, **options)
    device = hook.ctx.device
    if not devices.is_gpu(device) and budget_mb is None:
        raise ConfigError("on CPU nothing runs out of memory: pass budget_mb (e.g. --memory-budget-mb 256) "
                          "to search against a budget, or run on a GPU profile")
    budget = int(budget_mb * MiB) if budget_mb else None
    probes: list[list] = []

    def fits(b: int) -> bool:
        peak = _step_peak(hook, cfg, b)
        probes.append([b, peak])
        return peak is not None and (budget is None or peak <= budget)

    # BatchNorm cannot normalise one sample per channel in training mode: image models start at 2.
    start = 2 if hook.task.kind == "vision" else 1
    try:
        best = search_max(fits, start=start, limit=limit)
    finally:
        hook.close()
        del hook
        free_device_memory(device, reset_peak=True)
    reached = all(peak is not None and (budget is None or peak <= budget) for _, peak in probes)
    return {"model": model, "max_micro_batch": best, "safe_micro_batch": safe_batch(best, start),
            "limit_reached": reached, "limit": limit,
            "budget_bytes": budget, "probes": probes, "device": str(device), "amp": cfg.precision.amp,
            "checkpointing": cfg.memory.checkpointing}


def memory_breakdown(model: str, *, profile: str = "smoke", batch: int | None = None, **options) -> dict:
    """Bytes by kind (parameters, gradients, optimizer state, activations, temporaries) at the peak of one
    training step, from MemTracker (works on CPU and GPU); on GPU also `torch.cuda.memory_summary()`."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from labkit.train import stand_in

    cfg, hook = _probe_hook(model, profile, **options)
    from labkit.runtime import rehearsal

    batch = batch or cfg.optim.batch
    stand_in.simulate_oom(cfg.replace(batch=batch))  # sized at the real batch; a rehearsal executes a small one
    x, y = _fake_batch(hook.task, hook.cfg, min(batch, REHEARSAL_BATCH) if rehearsal.active() else batch,
                       hook.ctx.device)
    # The first step creates the optimizer state. On a GPU it runs at the measured batch (cuDNN's autotuning
    # and the allocator's blocks for this shape come before the tracked step); on CPU the state is all it is
    # for, so it steps two samples (BatchNorm's minimum): smoke's bf16 breakdown at batch 64 took 49 CPU s.
    warm = (x, y) if devices.is_gpu(hook.ctx.device) else (x[:REHEARSAL_BATCH], y[:REHEARSAL_BATCH])
    hook.train_step([warm], hook.task.loss)
    tracker = MemTracker()
    tracker.track_external(hook.model, hook.optimizer)
    with tracker:
        hook.train_step([(x, y)], hook.task.loss)
    peak = tracker.get_tracker_snapshot("peak")
    out = {getattr(k, "value", str(k)): int(v) for snap in peak.values() for k, v in snap.items()}
    device = hook.ctx.device
    if devices.is_gpu(device):
        out["cuda_memory_summary"] = allocator.memory_summary(device)
    hook.close()
    del hook, x, y
    free_device_memory(device, reset_peak=True)
    return out


def _isolated(kwargs: dict) -> dict:
    """`find_max_batch(**kwargs, isolate=False)` in a fresh interpreter; its report."""
    import json
    import subprocess
    import sys

    from labkit.errors import LabkitError

    proc = subprocess.run([sys.executable, "-m", "labkit.train.batch_finder", json.dumps(kwargs)],
                          capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise LabkitError(f"the batch probes of {kwargs['model']} failed in their own process "
                          f"(exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


if __name__ == "__main__":  # `_isolated`'s child: one JSON argument, the report as the last line
    import json
    import sys

    print(json.dumps(find_max_batch(**json.loads(sys.argv[1]), isolate=False)))
