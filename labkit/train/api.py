"""Python API for notebooks and the CLI: `run(...)` trains and returns the run's `RunRecord`.

`run(strategy='single', ...)` trains in this process (a notebook keeps its imports warm); any
strategy that needs a process group, or `nproc > 1`, is launched under torchrun through
`labkit.runtime.launch.run` and the record is read back from OUT/results.jsonl by its run id.
In a rehearsal (`labkit.runtime.rehearsal`) `make_config` sizes every run at its real size first, then hands
back the stand-in the rehearsal executes, and `run` launches it in this process over the fake group.
Introduced in notebook 02_single_gpu.
"""
from __future__ import annotations

import uuid

from labkit import parallel, results
from labkit.runtime import rehearsal
from labkit.train import stand_in
from labkit.errors import ConfigError
from labkit.train.checkpoint import Deadline
from labkit.train.config import TrainConfig, from_dict, parse_deadline

WORKER = "labkit.train.worker"


def make_config(strategy: str, model: str, *, rehearse_as: str | None = "run", real: bool = False,
                **options) -> TrainConfig:
    """A resolved, validated TrainConfig (profile defaults filled in) with a fresh run id.

    Rehearsal: the run is sized at its real size and logged as `rehearse_as` (`stand_in.check_launch`;
    None for probes that size themselves), and the stand-in config is returned (the real one with
    `real=True`: a probe sizes that and executes `stand_in.stand_in` of it)."""
    if options.get("deadline") is None:
        # On a reserved node the lease's end is the deadline unless one is given, so a checkpoint
        # is written before the node goes away (labkit.lease: LABKIT_LEASE_END or python-chi).
        from labkit import lease
        options["deadline"] = lease.default_deadline_text()
    cfg = from_dict({"strategy": strategy, "model": model, **options})
    if not cfg.run.run_id:
        cfg = cfg.replace(run_id=uuid.uuid4().hex[:12])
    cfg = cfg.resolve()
    parallel.strategy_class(cfg.run.strategy).check(cfg, cfg.world_size)
    if cfg.checkpoint.deadline:  # fail here, before paying for a launch
        Deadline(parse_deadline(cfg.checkpoint.deadline), cfg.checkpoint.deadline_margin_s).check_start()
    if cfg.profiling.trace_steps:  # the trace window must fit the run (labkit.profiling.profiler), also before a launch
        from labkit.profiling import profiler as profiling
        profiling.check(cfg, cfg.profile.device)
    if rehearse_as:
        cls = parallel.strategy_class(cfg.run.strategy)
        stand_in.check_launch(cfg, via=rehearse_as, launched=cfg.world_size > 1 or cls.needs_process_group,
                              profile_given="profile" in options)
    return cfg if real else stand_in.stand_in(cfg)


def run(strategy: str, model: str, *, timeout_s: float | None = None, stream: bool = True,
        **options) -> results.RunRecord | None:
    """Train and return the RunRecord (None on nodes other than node 0 of a multi-node job).

    `options` are TrainConfig fields by their flat names (profile, nproc, steps, out, seed, amp, accum,
    checkpointing, batch, lr, ..., the `labkit train` option names): `config.FIELD_SECTION` maps each
    to its section; an unknown name is a ConfigError listing the valid ones.
    """
    cfg = make_config(strategy, model, **options)
    require_hardware(cfg.profile)
    cls = parallel.strategy_class(cfg.run.strategy)
    if cfg.world_size == 1 and not cls.needs_process_group:
        return _in_process(cfg)
    if rehearsal.active():  # the node's launch, stood in for in this process (labkit.train.stand_in)
        stand_in.launch([cfg], env=cls.launch_env(cfg))
        return record_of(cfg.run.out, cfg.run.run_id)
    from labkit.runtime import launch, rank_pool

    # Warm ranks (labkit.runtime.rank_pool) in a notebook: the ranks of the previous run take this one if they can
    # (only a pool started with the same threads: labkit.runtime.rank_pool.PoolKey).
    rank_pool.run(WORKER, ["--config-json", cfg.to_json()], nproc=cfg.launch.nproc, timeout_s=_timeout(cfg, timeout_s),
                  env=cls.launch_env(cfg), nnodes=cfg.launch.nnodes, node_rank=cfg.launch.node_rank,
                  rdzv_endpoint=cfg.launch.rdzv_endpoint, stream=stream, group=process_group(cfg),
                  threads=cfg.launch.threads or launch.cpu_threads(cfg.launch.nproc,
                                                                   cpu_heavy=cfg.run.strategy in launch.CPU_HEAVY_STRATEGIES))
    if cfg.launch.node_rank != 0:
        return None
    return record_of(cfg.run.out, cfg.run.run_id)


def process_group(cfg: TrainConfig) -> str:
    """What the ranks' process group is made of (labkit.train.worker.join_group): warm ranks serve only
    runs that agree on it."""
    prof = cfg.profile
    return f"{prof.backend}/{prof.device}/{prof.collective_timeout_s:g}"


def require_hardware(profile) -> None:
    """HardwareError in one line when this machine lacks the profile's GPUs (before any launch):
    `labkit.runtime.envinfo.require`. CPU profiles pass without querying devices; so does a rehearsal."""
    from labkit.runtime import envinfo
    envinfo.require(profile)


def _in_process(cfg: TrainConfig) -> results.RunRecord:
    from labkit.train.loop import train
    from labkit.train.metrics import free_device_memory
    from labkit.train.worker import local_context

    ctx = local_context(cfg)
    try:
        if cfg.launch.threads is None:
            return train(cfg, ctx)
        # --threads N: this process computes with N intra-op threads, as a launched rank would, and gives
        # the caller's count back (a 1-rank baseline on both cores of a 2-core machine would measure threads).
        from labkit.train.metrics import intra_op_threads

        with intra_op_threads(cfg.launch.threads):
            return train(cfg, ctx)
    finally:
        free_device_memory(ctx.device)  # hand the GPU back to the ranks a later launch starts


def record_of(out, run_id: str) -> results.RunRecord:
    """The record a run appended to OUT/results.jsonl, found by its run id."""
    for record in reversed(results.load(out)):
        if record.train.run_id == run_id:
            return record
    raise ConfigError(f"no record with run_id {run_id!r} in {out}/results.jsonl; the run did not finish")


def _timeout(cfg: TrainConfig, timeout_s: float | None) -> float:
    """The profile's wall-clock limit, stretched to the deadline (plus a minute) when one is given."""
    limit = timeout_s or cfg.profile.timeout_s
    if cfg.checkpoint.deadline:
        import datetime as _dt
        left = (parse_deadline(cfg.checkpoint.deadline) - _dt.datetime.now(_dt.timezone.utc)).total_seconds()
        limit = max(limit, left + 60.0)
    return limit
