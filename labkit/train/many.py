"""Several training runs inside ONE torchrun launch: `run_many(runs, model, nproc=...)`.

Each run is exactly what `labkit train` runs (same `TrainConfig`, loop and `RunRecord` in
OUT/results.jsonl), but the ranks start -- import torch, transformers, DeepSpeed; join the process
group -- once for all of them, which on a laptop is most of a smoke run's wall time. Notebooks 04
and 05 compare sharding strategies this way (`labkit.parallel.studies.sweep`), notebook 07 pipeline
schedules (`labkit.parallel.studies.run_together`).

An optional `before` hook, named by import path ("package.module:function"), runs on every rank
inside the same process group before the first run: `function(spec, first_config, ctx)` with the
JSON-able `spec` given to `run_many` (fsdp's wrap study is one).
Per-rank entry point: `python -m labkit.train.many --configs-json '[...]'`.
"""
from __future__ import annotations

import importlib
import json

from labkit.errors import ConfigError

ENTRY = "labkit.train.many"


def configs_for(runs: list, model: str, *, nproc: int, out: str, **options) -> list:
    """Resolved, validated TrainConfigs of `runs`: strategy names or (strategy, {option: value}) pairs
    whose options override the shared `options` for that run (a "model" option overrides `model`)."""
    from labkit.train.api import make_config

    configs = []
    for run in runs:
        name, own = (run, {}) if isinstance(run, str) else run
        merged = {"nproc": nproc, "out": out, **options, **own}
        configs.append(make_config(name, merged.pop("model", model), **merged))
    return configs


def run_many(runs: list, model: str, *, nproc: int = 2, out: str = "runs", stream: bool = True,
             timeout_s: float | None = None, before: tuple[str, object] | None = None, **options) -> list:
    """Train each of `runs` in turn inside one torchrun launch of `nproc` ranks; their RunRecords, in order.

    `options` are TrainConfig fields shared by all runs (profile, steps, amp, progress, ...).
    `before` = ("module:function", spec): called on every rank before the runs (see the module doc);
    with no runs the launch does only that, under a 'ddp' config of `model` and `options`.
    The time limit is the profile's per run unless `timeout_s` is given.
    """
    from labkit.runtime import launch, rank_pool, rehearsal
    from labkit import parallel
    from labkit.train import stand_in
    from labkit.train.api import make_config, process_group, record_of, require_hardware

    configs = configs_for(runs, model, nproc=nproc, out=out, **options)
    if not configs and before is None:
        raise ConfigError("run_many got no runs and no `before` hook; pass strategy names such as ['ddp', 'fsdp']")
    first = configs[0] if configs else make_config("ddp", model, nproc=nproc, out=out, **options)
    require_hardware(first.profile)  # one line before any launch, not a rank traceback
    env: dict[str, str] = {}
    for cfg in configs:
        env.update(parallel.strategy_class(cfg.run.strategy).launch_env(cfg))
    args = ["--first", first.to_json(), "--configs-json", json.dumps([c.to_json() for c in configs])]
    if before is not None:
        path, spec = before
        _resolve(path)  # a wrong path fails here, not on every rank after the launch
        args += ["--before", path, "--before-json", json.dumps(spec)]
    if rehearsal.active():  # the node's launch, stood in for in this process (labkit.train.stand_in)
        hook = dict(first=first, before=before[0], spec=before[1]) if before else {"first": first}
        stand_in.launch(configs, first=first, env=env, train_all=lambda cfgs, ctx: train_all(cfgs, ctx, **hook))
        return [record_of(cfg.run.out, cfg.run.run_id) for cfg in configs]
    limit = timeout_s or first.profile.timeout_s * max(1, len(configs))
    heavy = any(cfg.run.strategy in launch.CPU_HEAVY_STRATEGIES for cfg in configs)
    rank_pool.run(ENTRY, args, nproc=nproc, timeout_s=limit, env=env, stream=stream,
                  threads=first.launch.threads or launch.cpu_threads(nproc, cpu_heavy=heavy), group=process_group(first))
    return [record_of(cfg.run.out, cfg.run.run_id) for cfg in configs]


def _resolve(path: str):
    """The callable named "package.module:function"."""
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"run_many hook {path!r} does not name a function ({exc}); "
                          "write it as 'package.module:function'") from exc


def train_all(configs: list, ctx, *, first=None, before: str = "", spec=None) -> None:
    """On one rank inside an initialised process group: the `before` hook, then `train` per config.

    Between runs the previous run's model, optimizer and engine are collected and (on CUDA) the
    allocator's cache emptied and its peak reset: otherwise a later run starts on a device still
    holding the earlier runs' state, and its peak (and an OOM) would include them."""
    from labkit.runtime.device import release_meshes
    from labkit.train.loop import train
    from labkit.train.metrics import free_device_memory

    if before:
        _resolve(before)(spec, first or configs[0], ctx)
        release_meshes()  # the hook's meshes and their (NCCL) groups are not the runs'
        free_device_memory(ctx.device, reset_peak=True)
    for cfg in configs:
        train(cfg, ctx)
        free_device_memory(ctx.device, reset_peak=True)


def parse_job(argv: list[str]):
    """(Profile, fn(ctx)) of one `run_many` launch: how warm ranks run it (labkit.runtime.rank_pool)."""
    import argparse

    from labkit.train.config import TrainConfig

    parser = argparse.ArgumentParser(prog=ENTRY, description="several training runs in one torchrun job")
    parser.add_argument("--first", required=True, help="resolved TrainConfig JSON: process group, hook")
    parser.add_argument("--configs-json", default="[]", help="JSON list of resolved TrainConfig JSON strings")
    parser.add_argument("--before", default="", help="'package.module:function' run before the configs")
    parser.add_argument("--before-json", default="null", help="JSON spec passed to the --before function")
    args = parser.parse_args(argv)
    first = TrainConfig.from_json(args.first)
    configs = [TrainConfig.from_json(text) for text in json.loads(args.configs_json)]
    return first.profile, lambda ctx: train_all(configs, ctx, first=first, before=args.before,
                                                   spec=json.loads(args.before_json))


def main(argv: list[str] | None = None) -> None:
    """Per-rank entry of `run_many`: one process group for all runs."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from labkit.train.worker import exit_now, join_group, run_then_leave

    profile, fn = parse_job(argv)

    @record
    def run_all() -> None:
        run_then_leave(fn, join_group(profile))  # destroy after a success, abort after an error (G4)

    run_all()
    exit_now()


if __name__ == "__main__":
    main()
