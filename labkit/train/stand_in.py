"""What a rehearsal executes in place of a run (`labkit.runtime.rehearsal` says what a rehearsal is).

`make_config` calls `check_launch` (the run sized at its real size on its profile, logged, and the
node's error raised for a run the node cannot hold) and then `stand_in` (the config that executes:
same strategy, ranks, options and precision; `STEPS` steps, short sequences, small images, the smallest
batch that splits the same way). `labkit.train.run` and `run_many` hand a launch to `launch` (rank 0 of
the job -- and the last rank for pipelines -- in this process over torch's fake process group) instead
of torchrun. The probes of `labkit.train.batch_finder` ask `simulate_oom`: the node's allocator, from
the estimator. Outside a rehearsal every function here does nothing.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any

from labkit.runtime import allocator
from labkit.runtime import device as devices
from labkit.runtime import rehearsal
from labkit.errors import ConfigError, LaunchError, RehearsalError

#: Run options that are bookkeeping, not what a run is (left out of the manifest).
_BOOKKEEPING = {"out", "run_id", "progress", "data", "seed", "steps", "deadline", "deadline_margin_s",
                "workers", "eval_batches", "eval_at_start", "warmup_steps", "trace_steps", "trace_with",
                "checkpoint_every", "resume", "profile", "strategy", "model", "nnodes", "node_rank",
                "rdzv_endpoint", "find_max_batch", "memory_budget_mb", "threads"}


# ------------------------------------------------------------------------------------ sizing
def describe(cfg) -> str:
    """'ddp tinyllama-1.1b x4 (amp bf16, batch 16 x 1024)': a run in one phrase."""
    shape = f"{cfg.optim.batch} x {cfg.run.seq_len}" if cfg.kind == "llm" else f"{cfg.optim.batch} x {cfg.run.image_size}px"
    extra = ([f"accum {cfg.optim.accum}"] if cfg.optim.accum > 1 else []) + \
        (["checkpointing"] if cfg.memory.checkpointing else []) + \
        ([f"cap {cfg.memory.memory_cap_gb:.3g} GB"] if cfg.memory.memory_cap_gb else [])
    return f"{cfg.run.strategy} {cfg.run.model} x{cfg.world_size} (amp {cfg.precision.amp}, batch {shape}" + \
        "".join(f", {e}" for e in extra) + ")"


def size(cfg, profile) -> dict[str, Any]:
    """{'bytes', 'capacity', 'fits', 'gpus_ok', 'note'} of a resolved config at its real size on `profile`."""
    from labkit.memory import runs

    cap = runs.capacity(profile, cfg.memory.memory_cap_gb)
    gpus_ok = profile.device != "cuda" or cfg.world_size <= profile.nproc
    try:
        used = runs.run_bytes(cfg) if cap is not None else None
    except ConfigError as exc:  # an estimator gap is a finding in the log, not a crash
        return dict(bytes=None, capacity=cap, fits=True, gpus_ok=gpus_ok, note=f"not sized: {exc}")
    return dict(bytes=used, capacity=cap, fits=cap is None or used <= cap, gpus_ok=gpus_ok, note="")


def fix(cfg) -> str:
    """What makes a run that does not fit fit."""
    if cfg.kind == "llm":
        return ("add checkpointing=True, gradient accumulation (accum=2, 4 ...) or a smaller batch / seq_len "
                "(labkit.course.profile_check.single_levers picks them), or shard it (fsdp, zero3)")
    return "lower the batch, add accum=2 (same global batch) or amp"


def check_launch(cfg, *, via: str = "run", launched: bool = False, profile_given: bool = True) -> None:
    """Rehearsal: size `cfg` (resolved, real size) on its profile, log it, and raise what the node would
    for a run it cannot hold: CUDA out of memory in this process, or for a `launched` run the launcher's
    LaunchError naming the rank that ran out of memory. Outside a rehearsal: nothing."""
    if not rehearsal.active():
        return
    from labkit.memory.runs import HEADROOM
    from labkit.profiles import get_profile

    profile = cfg.profile
    verdict = size(cfg, profile)
    rehearsal.record("run", via=via, strategy=cfg.run.strategy, model=cfg.run.model, options=options_of(cfg),
                     profile=cfg.run.profile, run_id=cfg.run.run_id, exec_count=rehearsal.exec_count(),
                     bytes=verdict["bytes"], capacity=verdict["capacity"], fits=verdict["fits"],
                     gpus_ok=verdict["gpus_ok"], may_oom=rehearsal.oom_expected(), describe=describe(cfg),
                     fix=fix(cfg), note=verdict["note"])
    rehearsal.banner(profile)
    what = describe(cfg)
    given = rehearsal.notebook_profile()
    # A run left on the default profile in a GPU profile's notebook (08 once); one a notebook puts on smoke's
    # CPU ranks on purpose (09's collectives on a one-GPU node) names its profile.
    if given and given != profile.name and get_profile(given).device == "cuda" and (
            not profile_given or profile.device == "cuda"):
        raise RehearsalError(f"rehearsal {given}: run {what} trains on profile {profile.name!r}, not the notebook's "
                             f"{given!r} (on the node it would not train what the lab says); fix: pass profile=PROFILE")
    if not verdict["gpus_ok"]:
        raise RehearsalError(f"rehearsal {profile.name}: run {what} asks for {cfg.world_size} GPUs, the node has "
                             f"{profile.nproc}; fix: use nproc=profile.nproc, or run this part on a profile with "
                             "more GPUs (e.g. smoke's CPU ranks) on one-GPU nodes")
    if not verdict["fits"]:
        cap = f"{cfg.memory.memory_cap_gb:g} GB cap" if cfg.memory.memory_cap_gb else f"{profile.gpu_memory_gb:g} GB {profile.gpu_name}"
        oom = devices.RehearsalOOM(f"CUDA out of memory (rehearsal {profile.name}): run {what} needs "
                                   f"~{verdict['bytes'] / 1e9:.1f} GB per GPU (estimate) > {HEADROOM:.0%} of the {cap}; "
                                   f"fix: {fix(cfg)}")
        if launched:  # on the node the ranks die of it and the launcher reports the first
            raise LaunchError(f"labkit.train.worker failed on rank 0: torch.OutOfMemoryError: {oom}", rank=0,
                              traceback=f"torch.OutOfMemoryError: {oom}") from oom
        raise oom
    allocator.simulate_peak(verdict["bytes"] or 0)


def simulate_oom(cfg) -> None:
    """Rehearsal's stand-in allocator for a probe (the max-batch finder, a memory breakdown): raise CUDA
    out of memory when `cfg` at its real size exceeds HEADROOM of the GPU, else report its estimate as
    the peak. Nothing outside a rehearsal or on CPU profiles."""
    if not (rehearsal.active() and devices.standing_in()):
        return
    profile = cfg.profile
    verdict = size(cfg, profile)
    if not verdict["fits"]:
        raise devices.RehearsalOOM(f"CUDA out of memory (rehearsal {profile.name}): {describe(cfg)} "
                                   f"~{verdict['bytes'] / 1e9:.1f} GB > the GPU's headroom (estimate)")
    allocator.simulate_peak(verdict["bytes"] or 0)


def options_of(cfg) -> dict[str, Any]:
    """What a run IS beyond strategy and model: its options that differ from the profile's defaults, plus
    its precision and ranks (the manifest's and `lab_runs`' options)."""
    from labkit.train.config import from_dict

    base = from_dict({"strategy": cfg.run.strategy, "model": cfg.run.model, "profile": cfg.run.profile}).resolve(cfg.profile)
    flat, default = cfg.flat(), base.flat()
    own = {k: v for k, v in flat.items() if k not in _BOOKKEEPING and v != default[k]}
    return {**own, "amp": cfg.precision.amp, "nproc": cfg.launch.nproc}


# ------------------------------------------------------------------------------------ the stand-in
#: Steps a stand-in run traces at most (the node's run traces its `trace_steps`).
TRACED_STEPS = 1


def stand_in(cfg):
    """The config a rehearsal executes for `cfg`: same strategy, ranks, options and precision; STEPS steps
    (more when a trace window needs them; TRACED_STEPS of them traced), short sequences, small images, one held-out batch and the
    smallest global batch that splits the same way (data-parallel ranks x accumulation x pipeline
    micro-batches). `cfg` itself outside a rehearsal."""
    if not rehearsal.active():
        return cfg
    from labkit.profiling.profiler import FIRST_TRACED

    # One traced step runs every line of a trace window (start, step marks, stop, export, summary): a second
    # one only doubles the profiler's most expensive part on a CPU (08's traced runs were most of its rehearsal).
    traced = min(cfg.profiling.trace_steps, TRACED_STEPS)
    steps = max(rehearsal.STEPS, FIRST_TRACED + traced if traced else 0)
    small = cfg.replace(steps=min(cfg.run.steps, steps) if cfg.run.steps else steps, workers=0, trace_steps=traced,
                        seq_len=min(cfg.run.seq_len or rehearsal.SEQ_LEN, rehearsal.SEQ_LEN),
                        image_size=min(cfg.run.image_size or rehearsal.IMAGE_SIZE, rehearsal.IMAGE_SIZE),
                        eval_batches=min(cfg.run.eval_batches, 1))
    return small.replace(batch=_small_batch(small))


def _small_batch(cfg) -> int:
    """The smallest global batch dividing the real one that every rank, micro-batch and pipeline chunk
    still gets (two samples each for BatchNorm), if the strategy accepts it; else the real batch."""
    from labkit import parallel

    cls = parallel.strategy_class(cfg.run.strategy)
    dims = cls.dims_for(cfg, cfg.world_size)
    chunks = (cfg.optim.microbatches or 2 * dims.pp) if dims.pp > 1 else 1
    unit = dims.dp_size * cfg.optim.accum * chunks * (2 if cfg.kind == "vision" else 1)
    if cfg.optim.batch % unit:
        return cfg.optim.batch
    try:
        cls.check(cfg.replace(batch=unit), cfg.world_size)
    except ConfigError:
        return cfg.optim.batch
    return unit


# ------------------------------------------------------------------------------------ in-process ranks
def launch(configs: list, *, first=None, env: dict | None = None, train_all=None) -> None:
    """Stand in for a torchrun launch of `configs`: rank 0 of the N-rank job in this process over the
    fake process group, then the last rank for pipelines (their stages differ), each running
    `train_all(configs, ctx)` (`labkit.train.many.train_all` with its hook; default: `train` per config).
    An exception becomes the LaunchError the node's launcher would raise."""
    from labkit.parallel.single import DistContext
    first = first or configs[0]
    world, profile = first.world_size, first.profile
    ranks = [0] + ([world - 1] if world > 1 and any(_staged(c) for c in configs) else [])
    for rank in ranks:
        with rank_environment(rank, world, env or {}):
            try:
                device, group = devices.join_group(profile, rank, world, local_rank=rank, fake=True)
                ctx = DistContext(rank=rank, world_size=world, local_rank=rank, device=device, group=group)
                (train_all or _train_each)(configs, ctx)
            except Exception as exc:
                last = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                raise LaunchError(f"labkit.train.worker failed on rank {rank}: {last}\n(rehearsal: rank {rank} "
                                  f"of {world} ran in this process over the fake process group)", rank=rank,
                                  traceback=_format(exc)) from exc
            finally:
                teardown()


def _train_each(configs: list, ctx) -> None:
    from labkit.train.loop import train
    from labkit.train.metrics import free_device_memory

    for cfg in configs:
        train(cfg, ctx)
        free_device_memory(ctx.device, reset_peak=True)


def _staged(cfg) -> bool:
    from labkit import parallel
    return parallel.strategy_class(cfg.run.strategy).dims_for(cfg, cfg.world_size).pp > 1


def _format(exc: BaseException) -> str:
    import traceback
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


@contextlib.contextmanager
def rank_environment(rank: int, world: int, env: dict):
    """What torchrun puts in a rank's environment (DeepSpeed reads it), restored afterwards."""
    from labkit.runtime.launch import environ

    with environ(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", DS_ACCELERATOR="cpu", **env):
        yield


def teardown() -> None:
    """Leave no process group behind (also DeepSpeed's cached handle to it)."""
    import gc

    import torch.distributed as dist

    devices.release_meshes()
    if dist.is_initialized():
        dist.destroy_process_group()
    ds = sys.modules.get("deepspeed.comm.comm")
    if ds is not None:
        ds.cdb = None  # DeepSpeed keeps the first group it saw; the next launch brings a new one
    gc.collect()
