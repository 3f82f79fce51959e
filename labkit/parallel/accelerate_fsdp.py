"""FSDP1 through Hugging Face accelerate: the config YAML people meet at work, and `accelerate launch`.

`labkit.parallel.fsdp` uses FSDP2 directly. Many teams instead write an accelerate config (by hand or
with `accelerate config`) and run `accelerate launch --config_file fsdp.yaml train.py`; accelerate then
wraps the model in FSDP1 (`FullyShardedDataParallel`) inside `accelerator.prepare`. The YAML for a
labkit strategy is `labkit.parallel.accelerate_config`'s; this module builds the launch command and
is the rank entry that trains through accelerate with the same data, loss and AdamW as
`labkit train`, recording a RunRecord.

The trap (docs/sharding.md, cpu-stack notes): without a GPU, accelerate does NOT run FSDP. With
ACCELERATE_USE_CPU=1 it silently builds DistributedDataParallel (distributed_type MULTI_CPU); without
it, every process trains alone (distributed_type NO). `detect` compares what was asked with what
accelerate built, and the record is named after what really ran ('accelerate-ddp', never '-fsdp').
Introduced in notebook 04_fsdp.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from labkit.errors import LaunchError
from labkit.parallel.accelerate_config import for_strategy, write_config


def launch_command(config_path: str | os.PathLike, args: list[str]) -> list[str]:
    """`accelerate launch --config_file PATH -m labkit.parallel.accelerate_fsdp ARGS` (pure)."""
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    return [accelerate, "launch", "--config_file", str(config_path), "-m", "labkit.parallel.accelerate_fsdp", *args]


def launch_env(profile: str) -> dict[str, str]:
    """On CPU accelerate needs ACCELERATE_USE_CPU=1 to start ONE job of N ranks (gloo); without it
    every process trains alone (distributed_type NO)."""
    from labkit.profiles import get_profile
    return {"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"} if get_profile(profile).device == "cpu" else {}


def run(strategy: str = "fsdp", model: str = "tiny-llama", *, profile: str = "smoke", nproc: int = 2,
        steps: int = 4, out: str = "runs", seed: int = 0, timeout_s: float = 600.0, **changes):
    """Write the config, `accelerate launch` the labkit trainer, return the run's RunRecord."""
    from labkit.profiles import get_profile
    from labkit.train.api import record_of

    from labkit.runtime import rehearsal

    cfg = for_strategy(strategy, profile, nproc=nproc, **changes)
    use_cpu = get_profile(profile).device == "cpu"
    path = write_config(cfg, out, strategy, use_cpu=use_cpu)
    if rehearsal.active() and not use_cpu:
        return _rehearse(strategy, model, path, profile=profile, nproc=nproc, steps=steps, out=out, seed=seed)
    run_id = f"acc-{int(time.time() * 1e3) % 10**10}"
    args = ["--strategy", strategy, "--model", model, "--profile", profile, "--steps", str(steps), "--out", str(out),
            "--seed", str(seed), "--run-id", run_id, "--config", str(path)]
    from labkit.runtime import rank_guard

    cmd = launch_command(path, args)
    cmd.insert(cmd.index("-m") + 1, rank_guard.__name__)  # each rank dies with accelerate (labkit.runtime.rank_guard)
    proc = subprocess.Popen(rank_guard.guarded(cmd), env={**os.environ, **launch_env(profile)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop_tree(proc)
        raise LaunchError(f"accelerate launch did not finish within {timeout_s:g} s; all its processes were "
                          "stopped. Raise timeout_s if the run needs longer") from None
    except BaseException:  # Ctrl-C / the notebook's interrupt button: never leave ranks behind
        _stop_tree(proc)
        raise
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-25:])
        raise LaunchError(f"accelerate launch failed (exit {proc.returncode}):\n{tail}", output=output)
    return record_of(out, run_id)


def _rehearse(strategy: str, model: str, path: Path, *, profile: str, nproc: int, steps: int, out: str, seed: int):
    """A rehearsal's stand-in (labkit.runtime.rehearsal): accelerate's FSDP1 needs CUDA, which a rehearsal does not
    have, so the config written above is resolved the way `accelerate launch` reads it on the node
    (`resolve_plugin`), labkit's own `strategy` trains in its place, and the record carries accelerate's
    facts as that plugin predicts them: an unmeasured prediction, marked `rehearsal`."""
    import dataclasses

    from labkit.runtime import device as devices
    from labkit import results
    from labkit.facts import AccelerateFacts
    from labkit.parallel.accelerate_config import resolve_plugin
    from labkit.train.api import run as train_run

    plugin = resolve_plugin(path)
    devices.record("accelerate_launch", command=launch_command(path.name, ["--strategy", strategy]), plugin=plugin)
    rec = train_run(strategy, model, profile=profile, nproc=nproc, steps=steps, out=out, seed=seed, stream=False,
                    progress=False, rehearse_as="accelerate")  # sized like the node's run; not a labkit lab run
    facts = {"requested_fsdp": True, "distributed_type": "FSDP", "wrapper": "FullyShardedDataParallel",
             "fsdp_effective": True, "silently_replaced": False, "mixed_precision": plugin["mixed_precision"]}
    record = dataclasses.replace(rec, strategy=record_name(facts, strategy), accelerate=AccelerateFacts(
        requested_strategy=strategy, accelerate_config=str(path), peak_measured=False, **facts))
    results.append(record, out)
    return record


def _stop_tree(proc: subprocess.Popen) -> None:
    """Kill `accelerate launch` and every process below it (torchrun, the ranks)."""
    import psutil

    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)


def detect(accelerator, model) -> dict:
    """What accelerate really built: distributed type, wrapper class, and whether it is FSDP."""
    from accelerate.utils import DistributedType

    requested = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    kind = accelerator.distributed_type
    effective = kind == DistributedType.FSDP and type(model).__name__ == "FullyShardedDataParallel"
    return {"requested_fsdp": requested, "distributed_type": str(kind.value), "wrapper": type(model).__name__,
            "fsdp_effective": effective, "silently_replaced": requested and not effective,
            "mixed_precision": str(accelerator.mixed_precision)}


def record_name(facts: dict, strategy: str) -> str:
    """The strategy name a record gets: what ran, never what was asked for."""
    if facts["fsdp_effective"]:
        return f"accelerate-{strategy}"
    return {"MULTI_CPU": "accelerate-ddp", "MULTI_GPU": "accelerate-ddp"}.get(facts["distributed_type"],
                                                                              "accelerate-unsharded")


# ------------------------------------------------------------------------------------------ rank entry
def _train(args) -> None:
    import torch
    from accelerate import Accelerator

    from labkit import results
    from labkit.zoo.models import build_model
    from labkit.train import metrics
    from labkit.train.api import make_config
    from labkit.train.data import StepLoader, build_datasets, make_task

    accelerator = Accelerator()
    cfg = make_config(args.strategy, args.model, profile=args.profile, nproc=accelerator.num_processes,
                      steps=args.steps, seed=args.seed, out=args.out)
    model = build_model(cfg.run.model, seed=cfg.run.seed)
    n_params = sum(p.numel() for p in model.parameters())
    # FSDP1: wrap first, then build the optimizer over the (sharded) parameters the wrapper exposes.
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=0.0))
    facts = detect(accelerator, model)
    if facts["silently_replaced"] and accelerator.is_main_process:
        print(f"WARNING: FSDP was requested but accelerate built {facts['wrapper']} "
              f"(distributed_type {facts['distributed_type']}): this run is NOT sharded.", flush=True)
    task = make_task(cfg)
    train_set, _ = build_datasets(cfg, task)
    loader = iter(StepLoader(train_set, global_batch=cfg.optim.batch, dp_rank=accelerator.process_index,
                             dp_size=accelerator.num_processes, seed=cfg.run.seed))
    losses, times = [], []
    for _ in range(cfg.run.steps):
        t0 = time.perf_counter()
        inputs, targets = (t.to(accelerator.device) for t in next(loader))
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(model, inputs, targets)
        accelerator.backward(loss)
        optimizer.step()
        losses.append(float(accelerator.reduce(loss.detach(), reduction="mean")))
        times.append(time.perf_counter() - t0)
    held = metrics.resident_bytes(model, optimizer, accelerator.device)
    # The CUDA allocator's peak on GPU (unverified on hardware here); CPU runs record 0 (not tracked).
    from labkit.runtime import allocator
    peak = allocator.max_memory_allocated(accelerator.device)
    per_rank = accelerator.gather_for_metrics([(*held, peak)], use_gather_object=True)
    if accelerator.is_main_process:
        results.append(_record(args, cfg, facts, losses, times, per_rank, n_params), cfg.run.out)
    accelerator.end_training()


def _record(args, cfg, facts: dict, losses: list, times: list, per_rank: list, n_params: int):
    """The RunRecord of an accelerate run, named after what ran (peak memory is not tracked here)."""
    from labkit import results
    from labkit.facts import AccelerateFacts, TrainFacts
    from labkit.train import metrics
    from labkit.train.config import AMP_DTYPES

    cols, world = list(zip(*per_rank)), len(per_rank)
    step = metrics.median_step_time(times, set(), min(2, len(times) - 1))
    return results.RunRecord(
        strategy=record_name(facts, args.strategy), model=cfg.run.model, profile=cfg.run.profile, world_size=world,
        steps=len(losses), losses=losses, step_time_s=step, samples_per_s=cfg.optim.batch / step if step else 0.0,
        peak_bytes=list(cols[4]), param_bytes=list(cols[0]), grad_bytes=list(cols[1]),
        optimizer_bytes=list(cols[2]), cpu_offload_bytes=list(cols[3]), trainable_params=n_params,
        device=cfg.profile.device,
        # The dtype accelerate trained in (the config's mixed_precision), not the profile's default.
        dtype=AMP_DTYPES[{"no": "none"}.get(facts["mixed_precision"], facts["mixed_precision"])],
        global_batch=cfg.optim.batch,
        train=TrainFacts(run_id=args.run_id),
        accelerate=AccelerateFacts(requested_strategy=args.strategy, accelerate_config=args.config,
                                   peak_measured=any(cols[4]), **facts))


def _main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="labkit.parallel.accelerate_fsdp",
                                     description="train under `accelerate launch` (labkit data, loss, AdamW)")
    for flag in ("--strategy", "--model", "--profile", "--out", "--run-id", "--config"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    _train(parser.parse_args(argv))


if __name__ == "__main__":
    _main()
