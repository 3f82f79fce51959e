"""The one training loop every strategy runs (the strategy only changes its `Strategy` hook).

Per step: fetch this dp rank's share of the global batch -> split into `accum` micro-batches ->
`hook.train_step` -> time it -> maybe checkpoint -> maybe stop for the deadline. At the end every
rank's facts are gathered (`all_gather_object`) and rank 0 appends ONE `RunRecord` to
OUT/results.jsonl. Introduced in notebook 02_single_gpu.
"""
from __future__ import annotations

import contextlib
import random
import sys
import time
from dataclasses import dataclass, field

import torch

from labkit.runtime import allocator
from labkit.runtime import device as devices
from labkit import parallel, results
from labkit.runtime import rehearsal
from labkit.profiling import profiler as profiling
from labkit.errors import ConfigError
from labkit.facts import TrainFacts
from labkit.train import memcap, metrics
from labkit.train.checkpoint import Checkpointer, Deadline, latest_checkpoint, read_meta
from labkit.train.config import AMP_DTYPES, parse_deadline
from labkit.train.data import StepLoader, build_datasets, eval_batches, make_task, split_micro

FLOPS_STEP, MEMORY_STEP = 0, 1  # process-local warm-up steps that carry the measurements


@dataclass
class _Progress:
    """What this process did: losses (global averages restored from a checkpoint, then local), times."""

    prior_losses: list[float] = field(default_factory=list)
    local_losses: list = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    """CPU-seconds of each step (all threads of this process): what the rank computed, not what it waited."""
    flops: list[float] = field(default_factory=list)
    resumed_from: int | None = None
    stopped: str | None = None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:
        pass


def configure_backends(device: torch.device) -> None:
    """cuDNN autotuning on CUDA: `cudnn.benchmark` times the convolution algorithms for each new input
    shape once and keeps the fastest (our shapes are fixed per run; NVIDIA's ResNet-50 reference
    numbers use it). Costs a slower first step (a warm-up step, outside the median) and bitwise
    reproducibility between runs. Unverified on hardware here: the gain is measured only on a GPU.
    TF32 off for matmuls AND cuDNN convolutions (torch defaults convolutions to TF32): an fp32 run is
    true fp32, and MFU uses the fp32 peak (`labkit.runtime.device.configure`)."""
    devices.configure(device, tf32=False, cudnn_benchmark=True)


def train(cfg, ctx):
    """Run `cfg` on this rank (`ctx`); returns the RunRecord on rank 0, None elsewhere.

    The meshes a finished run built are destroyed with it: their NCCL communicators hold GPU memory the
    allocator's peak does not show, and a launch that runs several configs would keep them all. A run
    that raised destroys nothing (a peer may still wait in a collective: destroy would hang, issue 38 G4):
    its groups are aborted (`labkit.runtime.device.abort_groups`) and the error goes on to the launcher."""
    cfg = cfg.resolve()
    meshes = devices.mesh_count()
    try:
        with memcap.applied(cfg.memory.memory_cap_gb, ctx.device):  # --memory-cap-gb on CUDA: the allocator's limit
            record = _train(cfg, ctx)
    except BaseException:
        devices.abort_groups(meshes)
        raise
    devices.release_meshes(meshes)
    return record


def _train(cfg, ctx):
    seed_everything(cfg.run.seed)
    task = make_task(cfg)
    hook = parallel.make_strategy(cfg.run.strategy, ctx, cfg, task)
    type(hook).check(cfg, ctx.world_size)
    deadline = Deadline(parse_deadline(cfg.checkpoint.deadline) if cfg.checkpoint.deadline else None, cfg.checkpoint.deadline_margin_s)
    deadline.check_start()
    configure_backends(ctx.device)
    hook.setup()
    try:
        ckpt = Checkpointer(cfg.run.out, ctx, cfg)
        progress = _restore(cfg, hook, ckpt)
        deadline.check_start()
        train_set, held_out = build_datasets(cfg, task)
        loader = StepLoader(train_set, global_batch=cfg.optim.batch, dp_rank=hook.dp_rank, dp_size=hook.dp_size,
                            seed=cfg.run.seed, workers=cfg.run.workers, start_step=len(progress.prior_losses),
                            pin_memory=devices.pin_memory(ctx.device))
        start_eval = _evaluate_at_start(cfg, ctx, hook, held_out)  # --eval-at-start: the held-out loss before
        peak = metrics.PeakMemory(ctx.device)
        tracer = profiling.StepTracer.for_run(cfg, ctx)  # --trace-steps N: torch.profiler over N steps
        try:
            _run_steps(cfg, ctx, hook, task, loader, ckpt, deadline, progress, peak, tracer)
            memcap.check(cfg.memory.memory_cap_gb, peak.result())  # on CPU: the cap against the tracked peak
            tracer.finish()  # rank 0 writes OUT/profiles/<run id>/: trace, memory timeline, summary
        finally:
            tracer.close()  # a failed step must not leave the profiler running in this process
        held = eval_batches(held_out, global_batch=cfg.optim.batch, dp_rank=hook.dp_rank, dp_size=hook.dp_size,
                            count=cfg.run.eval_batches)
        evaluation = hook.evaluate([_to_device(b, ctx.device, cfg.precision.channels_last) for b in held]) if held else None
        facts = dict(losses=_floats(progress.local_losses), times=progress.times, cpu_times=progress.cpu_times,
                     flops=progress.flops,
                     peak=peak.result(), bytes=tuple(hook.resident_bytes()), eval=evaluation, eval_start=start_eval)
        gathered = _gather(ctx, facts)
        if not ctx.is_main:
            return None
        record = _record(cfg, ctx, hook, task, progress, gathered, len(train_set), ckpt)
        path = results.append(record, cfg.run.out)
        _say(ctx, f"appended the {cfg.run.strategy} record to {path}")
        return record
    finally:
        hook.close()


def _restore(cfg, hook, ckpt) -> _Progress:
    """Load the newest complete checkpoint for --resume; otherwise make sure we start clean."""
    progress = _Progress()
    ckpt.clean_stale()
    found = latest_checkpoint(cfg.run.out) if cfg.checkpoint.resume else None
    if found is not None:
        saved = read_meta(found)["step"]
        if saved >= cfg.run.steps:
            raise ConfigError(f"{found} is already at step {saved} >= --steps {cfg.run.steps}; raise --steps to train further")
        meta = ckpt.load(hook, found)
        progress.prior_losses, progress.resumed_from = list(meta["losses"]), meta["step"]
        _say(hook.ctx, f"resumed from {found} (step {meta['step']})")
    elif cfg.checkpoint.resume:
        _say(hook.ctx, f"--resume: no checkpoint yet in {ckpt.root}; starting from step 0")
    elif cfg.checkpoint.checkpoint_every or cfg.checkpoint.deadline:
        ckpt.check_fresh()
    return progress


def _run_steps(cfg, ctx, hook, task, loader, ckpt, deadline, progress, peak, tracer) -> None:
    from tqdm import tqdm

    start = len(progress.prior_losses)
    measure_flops = hook.flops_per_step(1) is None  # vision: counted in the first step
    batches = iter(loader)
    bar = tqdm(total=cfg.run.steps, initial=start, desc=f"{cfg.run.strategy} {cfg.run.model}", unit="step",
               disable=not (ctx.is_main and cfg.run.progress), file=sys.stderr, mininterval=0.5)
    for local, step in enumerate(range(start, cfg.run.steps)):
        tracer.before(local)
        t0, c0 = time.perf_counter(), time.process_time()
        inputs, targets = _to_device(next(batches), ctx.device, cfg.precision.channels_last)
        micro = split_micro(inputs, targets, cfg.optim.accum)
        counted = measure_flops and not cfg.precision.compile  # a compiled graph hides its ops from FlopCounterMode
        with _measurement(local, counted, hook, peak, progress.flops, cfg.run.steps - start) as loss_fn:
            loss = hook.train_step(micro, loss_fn(task.loss))
        allocator.synchronize(ctx.device)  # CUDA is asynchronous: time the work, not the launch
        progress.times.append(time.perf_counter() - t0)
        progress.cpu_times.append(time.process_time() - c0)
        if local == FLOPS_STEP and measure_flops and cfg.precision.compile:  # outside the timed step
            progress.flops.append(metrics.uncompiled_step_flops(hook.model, [x for x, _ in micro]))
        tracer.after(local)
        progress.local_losses.append(None if loss is None else loss.detach())
        bar.update(1)
        if local % 10 == 0 and loss is not None:
            bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)
        done = step + 1
        if cfg.checkpoint.checkpoint_every and done % cfg.checkpoint.checkpoint_every == 0 and done < cfg.run.steps:
            _save(ckpt, hook, ctx, progress, done, deadline)
        if deadline.when is not None and done < cfg.run.steps and _agree(ctx, deadline.should_stop(progress.times[-1])):
            _save(ckpt, hook, ctx, progress, done, deadline)
            progress.stopped = "deadline"
            _say(ctx, f"\nstopping at step {done}: the deadline {cfg.checkpoint.deadline} is within "
                      f"{deadline.margin_s:.0f} s; resume later with --resume")
            break
    bar.close()


@contextlib.contextmanager
def _measurement(local: int, measure_flops: bool, hook, peak, flops: list, todo: int):
    """Count FLOPs in local step 0 and track peak memory in local step 1 (both warm-up steps).

    Yields `wrap(loss_fn)`: the loss function to use in this step (the memory tracker hooks into it)."""
    with contextlib.ExitStack() as stack:
        if local == FLOPS_STEP and measure_flops:
            stack.enter_context(metrics.count_flops(flops))
        wrap = lambda loss_fn: loss_fn  # noqa: E731
        if local == min(MEMORY_STEP, todo - 1):
            wrap = stack.enter_context(peak.track(hook.model, hook.optimizer))
        yield wrap


def _save(ckpt, hook, ctx, progress, step: int, deadline) -> None:
    losses = progress.prior_losses + _average(_gather(ctx, _floats(progress.local_losses)))
    ckpt.save(hook, step, losses)
    deadline.slowest_save = max(ckpt.save_times)


def _agree(ctx, flag: bool) -> bool:
    """Rank 0's decision for all ranks (clocks differ; a split decision would deadlock a collective)."""
    if ctx.group is None:
        return flag
    import torch.distributed as dist
    t = torch.tensor([int(flag)], device=ctx.device)
    dist.broadcast(t, src=0, group=ctx.group)
    return bool(t.item())


def _to_device(batch, device, channels_last: bool):
    inputs, targets = (t.to(device, non_blocking=True) for t in batch)
    if channels_last and inputs.dim() == 4:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    return inputs, targets


def _floats(values) -> list:
    return [None if v is None else float(v) for v in values]


def _gather(ctx, obj) -> list:
    if ctx.group is None:
        return [obj]
    import torch.distributed as dist
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=ctx.group)
    return out


def _average(per_rank: list[list]) -> list[float]:
    """Per-step mean over the ranks that have a loss (pipeline: only the last stage)."""
    steps = zip(*per_rank) if per_rank else []
    return [sum(v for v in row if v is not None) / max(1, sum(v is not None for v in row)) for row in steps]


def _say(ctx, text: str) -> None:
    if ctx.is_main:
        print(text, flush=True)


def _record(cfg, ctx, hook, task, progress, gathered, dataset_size, ckpt):
    losses = progress.prior_losses + _average([g["losses"] for g in gathered])
    skip = {FLOPS_STEP, MEMORY_STEP, *profiling.window(cfg)}  # traced steps run slower
    step_time = max(metrics.median_step_time(g["times"], skip, cfg.run.warmup_steps) for g in gathered)
    samples_per_s = cfg.optim.batch / step_time if step_time else 0.0
    global_tokens = cfg.optim.batch * task.tokens_per_sample
    flops = hook.flops_per_step(global_tokens)
    if flops is None:
        flops = sum(g["flops"][0] for g in gathered if g["flops"])
    peak_tf = metrics.peak_tflops(ctx.device, AMP_DTYPES[cfg.precision.amp], fallback=_profile_peak(cfg))
    steps_per_epoch = dataset_size // cfg.optim.batch
    per_rank = list(zip(*[g["bytes"] for g in gathered]))
    train = TrainFacts(
        run_id=cfg.run.run_id, device_name=metrics.device_name(ctx.device), amp=cfg.precision.amp, accum=cfg.optim.accum,
        micro_batch=cfg.optim.batch // hook.dp_size // cfg.optim.accum, dp_size=hook.dp_size, lr=cfg.optim.lr,
        activation_checkpointing=cfg.memory.checkpointing, channels_last=cfg.precision.channels_last,
        compile=cfg.precision.compile, data=cfg.run.data, seed=cfg.run.seed, dataset_size=dataset_size,
        steps_per_epoch=steps_per_epoch, epoch_time_s=steps_per_epoch * step_time,
        cpu_step_time_s=[metrics.median_step_time(g["cpu_times"], skip, cfg.run.warmup_steps) for g in gathered],
        flops_per_step=flops, achieved_tflops=flops / step_time / 1e12 if step_time else 0.0,
        peak_tflops_per_device=peak_tf, resumed_from=progress.resumed_from, stopped=progress.stopped,
        checkpoint_save_s=ckpt.save_times, **_eval_summary(gathered), **_eval_summary(gathered, "eval_start"),
        **profiling.record_facts(cfg))
    return results.RunRecord(
        strategy=cfg.run.strategy, model=cfg.run.model, profile=cfg.run.profile, world_size=ctx.world_size,
        steps=len(losses), losses=losses, step_time_s=step_time, samples_per_s=samples_per_s,
        peak_bytes=[g["peak"] for g in gathered], param_bytes=list(per_rank[0]), grad_bytes=list(per_rank[1]),
        optimizer_bytes=list(per_rank[2]), cpu_offload_bytes=list(per_rank[3]),
        trainable_params=hook.trainable_params(), device=devices.mesh_device_type(ctx.device),
        dtype=AMP_DTYPES[cfg.precision.amp], rehearsal=rehearsal.active(),
        global_batch=cfg.optim.batch, tokens_per_s=samples_per_s * task.tokens_per_sample,
        mfu=metrics.mfu(flops, step_time, ctx.world_size, peak_tf), train=train, **hook.record_facts())


def _profile_peak(cfg) -> float:
    """The profile's `peak_tflops` when the run computes in the profile's dtype (a GPU missing from
    `metrics.PEAK_TFLOPS` still gets an MFU, issue 38 G8), else 0."""
    prof = cfg.profile
    return prof.peak_tflops if AMP_DTYPES[cfg.precision.amp] == prof.dtype else 0.0


def _eval_summary(gathered, key: str = "eval") -> dict:
    """{'<key>_loss', '<key>_accuracy'} over every rank's held-out sums ('eval' after training, 'eval_start' before)."""
    evals = [g[key] for g in gathered if g[key]]
    count = sum(e["count"] for e in evals)
    if not count:
        return {}
    return {f"{key}_loss": sum(e["loss_sum"] for e in evals) / count,
            f"{key}_accuracy": sum(e["correct"] for e in evals) / count}


def _evaluate_at_start(cfg, ctx, hook, held_out) -> dict | None:
    """The held-out sums of the model before its first step (a fine-tune's base: 06, 08), when asked for.
    `Strategy.evaluate` itself, not a subclass's (LoRA's also saves its adapters, which do not exist yet)."""
    if not cfg.run.eval_at_start:
        return None
    held = eval_batches(held_out, global_batch=cfg.optim.batch, dp_rank=hook.dp_rank, dp_size=hook.dp_size,
                        count=cfg.run.eval_batches)
    if not held:
        return None
    return parallel.Strategy.evaluate(hook, [_to_device(b, ctx.device, cfg.precision.channels_last) for b in held])
