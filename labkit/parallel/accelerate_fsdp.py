"""FSDP1 through Hugging Face accelerate: the config YAML people meet at work, and `accelerate launch`.

`labkit.parallel.fsdp` uses FSDP2 directly. Many teams instead write an accelerate config (by hand or
with `accelerate config`) and run `accelerate launch --config_file fsdp.yaml train.py`; accelerate then
wraps the model in FSDP1 (`FullyShardedDataParallel`) inside `accelerator.prepare`. This module writes
that YAML for a labkit strategy, builds the launch command, and trains through accelerate with the
same data, loss and AdamW as `labkit train`, recording a RunRecord.

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
from dataclasses import dataclass
from pathlib import Path

from labkit.errors import ConfigError, LaunchError, choices_error

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP")
#: labkit strategy -> (FSDP1 sharding strategy, offload_params)
STRATEGY_MAP = {"fsdp": ("FULL_SHARD", False), "fsdp-grad-op": ("SHARD_GRAD_OP", False),
                "fsdp-no-shard": ("NO_SHARD", False), "fsdp-hybrid": ("HYBRID_SHARD", False),
                "fsdp-offload": ("FULL_SHARD", True)}
_MIXED = {"none": "no", "bf16": "bf16", "fp16": "fp16"}


@dataclass(frozen=True)
class AccelerateFsdpConfig:
    """The FSDP part of an accelerate config file (`fsdp_config:` keys without their `fsdp_` prefix)."""

    sharding_strategy: str = "FULL_SHARD"
    """FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), NO_SHARD (DDP), HYBRID_SHARD (ZeRO-3 in a node)."""
    auto_wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    """TRANSFORMER_BASED_WRAP (one FSDP unit per block class) or SIZE_BASED_WRAP (by parameter count)."""
    transformer_layer_cls_to_wrap: str = "LlamaDecoderLayer"
    """Block class name(s), comma-separated, for TRANSFORMER_BASED_WRAP."""
    min_num_params: int = 100_000_000
    """SIZE_BASED_WRAP: a subtree with at least this many unwrapped parameters becomes a unit."""
    offload_params: bool = False
    """Keep parameters and gradients in host memory (and step there): fits more, runs much slower."""
    cpu_ram_efficient_loading: bool = True
    """from_pretrained loads the checkpoint on rank 0 only; the others build on the meta device."""
    sync_module_states: bool = True
    """Broadcast rank 0's weights at wrap time (required by cpu_ram_efficient_loading)."""
    mixed_precision: str = "no"
    """accelerate's mixed_precision: no, bf16 or fp16."""
    num_processes: int = 2
    num_machines: int = 1
    state_dict_type: str = "SHARDED_STATE_DICT"
    use_orig_params: bool = True
    """Keep the original parameters visible (needed for per-parameter optimizer groups and LoRA)."""

    def __post_init__(self) -> None:
        if self.sharding_strategy not in SHARDING_STRATEGIES:
            raise choices_error("sharding_strategy", self.sharding_strategy, SHARDING_STRATEGIES)
        if self.auto_wrap_policy not in WRAP_POLICIES:
            raise choices_error("auto_wrap_policy", self.auto_wrap_policy, WRAP_POLICIES)
        if self.cpu_ram_efficient_loading and not self.sync_module_states:
            raise ConfigError("cpu_ram_efficient_loading=True needs sync_module_states=True: ranks > 0 load "
                              "nothing and must receive rank 0's weights")
        if self.mixed_precision not in _MIXED.values():
            raise choices_error("mixed_precision", self.mixed_precision, _MIXED.values())
        for name in ("min_num_params", "num_processes", "num_machines"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r}; it must be a positive integer")


def for_strategy(strategy: str, profile: str = "smoke", *, nproc: int | None = None, amp: str | None = None,
                 **changes) -> AccelerateFsdpConfig:
    """The accelerate FSDP config equivalent to labkit strategy `strategy` on `profile`.

    On CPU profiles sync_module_states / cpu_ram_efficient_loading are off: accelerate's sync needs an
    accelerator device and raises "no available devices" otherwise.
    """
    from labkit.profiles import get_profile

    if strategy not in STRATEGY_MAP:
        raise choices_error("accelerate FSDP strategy", strategy, STRATEGY_MAP)
    prof = get_profile(profile)
    sharding, offload = STRATEGY_MAP[strategy]
    gpu = prof.device == "cuda"
    mixed = _MIXED[amp or {"float32": "none", "bfloat16": "bf16", "float16": "fp16"}[prof.dtype]]
    fields = dict(sharding_strategy=sharding, offload_params=offload, cpu_ram_efficient_loading=gpu,
                  sync_module_states=gpu, mixed_precision=mixed, num_processes=nproc or prof.nproc)
    return AccelerateFsdpConfig(**{**fields, **changes})


def config_dict(c: AccelerateFsdpConfig, *, use_cpu: bool = False) -> dict:
    """The YAML content `accelerate config` would write for `c` (accelerate 1.x, FSDP version 1)."""
    fsdp = {"fsdp_version": 1,
            # Both keys, same value. accelerate >= 1.6 documents fsdp_reshard_after_forward for FSDP1, but
            # its plugin takes sharding_strategy FIRST, and `accelerate launch` always sets it from
            # --fsdp_sharding_strategy (default FULL_SHARD): with only the new key every variant would
            # silently run FULL_SHARD (accelerate 1.15 FullyShardedDataParallelPlugin.__post_init__).
            "fsdp_sharding_strategy": c.sharding_strategy,
            "fsdp_reshard_after_forward": c.sharding_strategy,
            "fsdp_auto_wrap_policy": c.auto_wrap_policy, "fsdp_offload_params": c.offload_params,
            "fsdp_cpu_ram_efficient_loading": c.cpu_ram_efficient_loading,
            "fsdp_sync_module_states": c.sync_module_states, "fsdp_state_dict_type": c.state_dict_type,
            "fsdp_use_orig_params": c.use_orig_params, "fsdp_backward_prefetch": "BACKWARD_PRE"}
    if c.auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
        fsdp["fsdp_transformer_layer_cls_to_wrap"] = c.transformer_layer_cls_to_wrap
    else:
        fsdp["fsdp_min_num_params"] = c.min_num_params
    return {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "fsdp_config": fsdp,
            "mixed_precision": c.mixed_precision, "num_machines": c.num_machines,
            "num_processes": c.num_processes * c.num_machines, "machine_rank": 0, "rdzv_backend": "static",
            "same_network": True, "main_training_function": "main", "use_cpu": use_cpu}


def write_config(c: AccelerateFsdpConfig, out: str | os.PathLike, name: str = "fsdp", *, use_cpu: bool = False) -> Path:
    """Write `c` as OUT/accelerate_<name>.yaml and return the path."""
    import yaml

    path = Path(out) / f"accelerate_{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# accelerate config written by labkit ({name}, FSDP1). Use it with:\n"
              f"#   accelerate launch --config_file {path.name} your_train.py\n"
              "# fsdp_sharding_strategy and fsdp_reshard_after_forward both hold the FSDP1 sharding strategy\n"
              "# (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD); accelerate reads the first one first.\n")
    path.write_text(header + yaml.safe_dump(config_dict(c, use_cpu=use_cpu), sort_keys=False), encoding="utf-8")
    return path


def resolve_plugin(config_path: str | os.PathLike) -> dict:
    """What accelerate itself makes of a config file: `accelerate launch`'s own argument parsing and
    environment, then the FullyShardedDataParallelPlugin the ranks would build (no launch, no GPU).

    Without an accelerator, the plugin's device probe for sync_module_states is stubbed (CUDA device 0);
    sharding strategy, offload and prefetch come from accelerate's code unchanged. The preflight
    compares them with what the labkit strategy asks for (`plugin_problems`).
    """
    from unittest import mock

    import torch
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils import dataclasses as acc_dataclasses
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_path), "train.py"])
    args, *_ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    stub = [] if torch.cuda.is_available() else [
        mock.patch.object(acc_dataclasses, "is_cuda_available", lambda: True),
        mock.patch.object(torch.cuda, "current_device", lambda: 0)]
    with mock.patch.dict(os.environ, env):
        for patch in stub:
            patch.start()
        try:
            plugin = FullyShardedDataParallelPlugin()
        finally:
            for patch in stub:
                patch.stop()
    sharding = plugin.sharding_strategy or plugin.reshard_after_forward  # what Accelerator.prepare passes
    return {"sharding_strategy": sharding.name, "offload_params": bool(plugin.cpu_offload.offload_params),
            "sync_module_states": bool(plugin.sync_module_states), "use_orig_params": bool(plugin.use_orig_params),
            "mixed_precision": env.get("ACCELERATE_MIXED_PRECISION", "no")}


def plugin_problems(strategy: str, profile: str, out: str | os.PathLike) -> list[str]:
    """Differences between labkit `strategy` and what accelerate would build from its config ([] = none)."""
    cfg = for_strategy(strategy, profile)
    got = resolve_plugin(write_config(cfg, out, f"check-{strategy}"))
    want = {"sharding_strategy": cfg.sharding_strategy, "offload_params": cfg.offload_params,
            "sync_module_states": cfg.sync_module_states, "mixed_precision": cfg.mixed_precision}
    return [f"{key}: config asks {value!r}, accelerate builds {got[key]!r}" for key, value in want.items()
            if got[key] != value]


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

    cfg = for_strategy(strategy, profile, nproc=nproc, **changes)
    use_cpu = get_profile(profile).device == "cpu"
    path = write_config(cfg, out, strategy, use_cpu=use_cpu)
    run_id = f"acc-{int(time.time() * 1e3) % 10**10}"
    args = ["--strategy", strategy, "--model", model, "--profile", profile, "--steps", str(steps), "--out", str(out),
            "--seed", str(seed), "--run-id", run_id, "--config", str(path)]
    from labkit import rank_guard

    cmd = launch_command(path, args)
    cmd.insert(cmd.index("-m") + 1, rank_guard.__name__)  # each rank dies with accelerate (labkit.rank_guard)
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
    from labkit.models import build_model
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
    peak = torch.cuda.max_memory_allocated(accelerator.device) if accelerator.device.type == "cuda" else 0
    per_rank = accelerator.gather_for_metrics([(*held, peak)], use_gather_object=True)
    if accelerator.is_main_process:
        results.append(_record(args, cfg, facts, losses, times, per_rank, n_params), cfg.run.out)
    accelerator.end_training()


def _record(args, cfg, facts: dict, losses: list, times: list, per_rank: list, n_params: int):
    """The RunRecord of an accelerate run, named after what ran (peak memory is not tracked here)."""
    from labkit import results
    from labkit.profiles import get_profile
    from labkit.train import metrics
    from labkit.train.config import AMP_DTYPES

    cols, world = list(zip(*per_rank)), len(per_rank)
    step = metrics.median_step_time(times, set(), min(2, len(times) - 1))
    return results.RunRecord(
        strategy=record_name(facts, args.strategy), model=cfg.run.model, profile=cfg.run.profile, world_size=world,
        steps=len(losses), losses=losses, step_time_s=step, samples_per_s=cfg.optim.batch / step if step else 0.0,
        peak_bytes=list(cols[4]), param_bytes=list(cols[0]), grad_bytes=list(cols[1]),
        optimizer_bytes=list(cols[2]), cpu_offload_bytes=list(cols[3]), trainable_params=n_params,
        device=get_profile(cfg.run.profile).device,
        # The dtype accelerate trained in (the config's mixed_precision), not the profile's default.
        dtype=AMP_DTYPES[{"no": "none"}.get(facts["mixed_precision"], facts["mixed_precision"])],
        global_batch=cfg.optim.batch,
        extra={"run_id": args.run_id, "requested_strategy": args.strategy, "accelerate_config": args.config,
               "peak_measured": any(cols[4]), **facts})


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
