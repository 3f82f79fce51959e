"""Per-rank entry point under torchrun: `python -m labkit.train.worker --config-json '{...}'`.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR; this module turns them into a
`DistContext` (the world group is passed down explicitly, never looked up as a global), runs the
loop and tears the group down. `@record` writes the rank's traceback to torchrun's error.json, which
`labkit.runtime.launch` turns into a `LaunchError` naming the failing rank.
`--serve JOBS` makes this rank a warm one that runs job after job in one process group (labkit.runtime.rank_pool).
Introduced in notebook 03_ddp.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from labkit.runtime import device as devices
from labkit.parallel.single import DistContext
from labkit.profiles import Profile
from labkit.train.config import TrainConfig
from labkit.train.loop import train


def init_distributed(cfg: TrainConfig) -> DistContext:
    """Join the job's process group (gloo on CPU, nccl on GPUs) and pick this rank's device."""
    return join_group(cfg.profile)


def join_group(prof: Profile) -> DistContext:
    """`init_distributed` for a resolved config's profile (warm ranks join once, for the first run's)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device, group = devices.join_group(prof, rank, world, local_rank=local_rank,
                                        timeout_s=prof.collective_timeout_s)
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=device, group=group)


def local_context(cfg: TrainConfig) -> DistContext:
    """The context of an in-process, single-device run (no process group)."""
    return DistContext(rank=0, world_size=1, local_rank=0, device=devices.for_rank(cfg.profile),
                       group=None)


def parse_job(argv: list[str]):
    """(Profile, fn(ctx)) of one run of this entry point: how warm ranks run it (labkit.runtime.rank_pool)."""
    parser = argparse.ArgumentParser(prog="labkit.train.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--config-json", required=True, help="a resolved TrainConfig as JSON")
    cfg = TrainConfig.from_json(parser.parse_args(argv).config_json)
    return cfg.profile, lambda ctx: train(cfg, ctx)


@record
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        serve(argv[1])  # never returns
    profile, fn = parse_job(argv)
    ctx = join_group(profile)
    run_then_leave(fn, ctx)
    exit_now()


def run_then_leave(fn, ctx: DistContext) -> None:
    """`fn(ctx)`, then destroy the process group, only after a success: after an error a peer may still
    wait in a collective and destroy would wait with it (pytorch#141510); the groups are aborted instead
    and the error goes to torchrun, which stops the other ranks (issue 38, G4)."""
    try:
        fn(ctx)
    except BaseException:
        devices.abort_groups()
        raise
    dist.destroy_process_group()


# ---------------------------------------------------------------- warm ranks (labkit.runtime.rank_pool)
def serve(jobs: str) -> None:
    """Run JOBS/job-1.json, job-2.json, ... as they appear, in one process group; never returns.

    A job is {"module": entry point offering `parse_job`, "argv": [...]}. After each, this rank writes
    JOBS/done-<n>-<rank>. A job that raises ends this rank (and, through torchrun, the pool): the launcher
    reports it as a cold run's failure and starts a fresh pool for the next run."""
    import importlib
    import itertools
    from pathlib import Path

    folder, ctx = Path(jobs), None
    for n in itertools.count(1):
        job = _next_job(folder / f"job-{n}.json")
        profile, fn = importlib.import_module(job["module"]).parse_job(job["argv"])
        if ctx is None:
            ctx = join_group(profile)
        with one_job(ctx):
            fn(ctx)
        sys.stdout.flush()
        sys.stderr.flush()
        (folder / f"done-{n}-{ctx.rank}").touch()


def _next_job(path) -> dict:
    import json
    import time

    while not path.exists():  # the launcher writes it atomically (rename)
        time.sleep(0.05)
    return json.loads(path.read_text())


#: torch's process-wide switches a run may flip: (getter, setter) pairs restored after each warm run.
def _torch_switches() -> list:
    b = torch.backends
    return [
        (torch.get_num_threads, torch.set_num_threads),
        (torch.get_default_dtype, torch.set_default_dtype),
        (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        (lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
         lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
        (lambda: b.cudnn.benchmark, lambda v: setattr(b.cudnn, "benchmark", v)),
        (lambda: b.cudnn.deterministic, lambda v: setattr(b.cudnn, "deterministic", v)),
        (lambda: b.cudnn.allow_tf32, lambda v: setattr(b.cudnn, "allow_tf32", v)),
        (lambda: b.cuda.matmul.allow_tf32, lambda v: setattr(b.cuda.matmul, "allow_tf32", v)),
        (lambda: b.cuda.matmul.allow_bf16_reduced_precision_reduction,
         lambda v: setattr(b.cuda.matmul, "allow_bf16_reduced_precision_reduction", v)),
        (lambda: b.cuda.matmul.allow_fp16_reduced_precision_reduction,
         lambda v: setattr(b.cuda.matmul, "allow_fp16_reduced_precision_reduction", v)),
    ]


def _process_groups() -> set:
    # torch keeps no public list of live groups; `_world.pg_map` is where destroy_process_group looks too.
    return set(getattr(dist.distributed_c10d, "_world").pg_map)


@contextlib.contextmanager
def one_job(ctx: DistContext):
    """Leave this warm rank as the run found it: subgroups, os.environ, torch switches, memory."""
    from labkit.train.metrics import free_device_memory

    env, switches = dict(os.environ), [(get, set_, get()) for get, set_ in _torch_switches()]
    groups = _process_groups()
    yield
    # the same order on every rank (a set's is not): NCCL's shutdown of a communicator may wait for its peers
    made = sorted((g for g in _process_groups() - groups if g is not ctx.group), key=lambda g: str(g.group_name))
    for group in made:
        dist.destroy_process_group(group)
    _forget_groups(made)
    os.environ.clear()
    os.environ.update(env)
    for _, set_, value in switches:
        set_(value)
    free_device_memory(ctx.device, reset_peak=True)


def _forget_groups(groups: list) -> None:
    """DeepSpeed caches the groups it made (e.g. its clone of the world group) in module globals of
    deepspeed.utils.groups; after they are destroyed the next run must make new ones, not reuse them."""
    ds_groups = sys.modules.get("deepspeed.utils.groups")
    if ds_groups is None or not groups:
        return
    gone = set(map(id, groups))
    for name, value in list(vars(ds_groups).items()):
        if id(value) in gone:
            setattr(ds_groups, name, None)
        elif isinstance(value, dict) and any(id(v) in gone for v in value.values()):
            setattr(ds_groups, name, {k: v for k, v in value.items() if id(v) not in gone})


def exit_now() -> None:
    """Leave a finished rank without the interpreter's teardown.

    Everything is written and the process group is destroyed; what is left is destroying C++
    objects (gloo / FSDP / DeepSpeed threads) in arbitrary order, which now and then aborts with
    "terminate called without an active exception" -- a failed rank for torchrun after a good run.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
