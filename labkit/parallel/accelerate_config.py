"""The accelerate config file (FSDP1) equivalent to a labkit FSDP strategy, and what accelerate makes of it.

`for_strategy` maps a labkit strategy to accelerate's `fsdp_config` (FULL_SHARD, SHARD_GRAD_OP, ...),
`write_config` writes the YAML `accelerate config` would, and `resolve_plugin` runs accelerate's own
argument parsing on it to see the FullyShardedDataParallelPlugin the ranks would build (the preflight
compares the two: `plugin_problems`). `labkit.parallel.accelerate_fsdp` launches with it.
Introduced in notebook 04_fsdp.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from labkit.errors import ConfigError, choices_error

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
    from labkit.runtime import device as devices

    stub = [] if devices.cuda_present() else [
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
