"""FSDP1 through accelerate (labkit.parallel.accelerate_fsdp): the YAML, the command, and the CPU trap."""
from __future__ import annotations

import numpy as np
import pytest
import yaml

from labkit.errors import ConfigError
from labkit.parallel import accelerate_config as acc_cfg
from labkit.parallel import accelerate_fsdp as acc
from test_sharding_memory import sweep_records


@pytest.mark.parametrize("strategy,sharding,offload", [
    ("fsdp", "FULL_SHARD", False), ("fsdp-grad-op", "SHARD_GRAD_OP", False), ("fsdp-no-shard", "NO_SHARD", False),
    ("fsdp-hybrid", "HYBRID_SHARD", False), ("fsdp-offload", "FULL_SHARD", True)])
def test_strategies_map_to_fsdp1_sharding(strategy, sharding, offload):
    c = acc_cfg.for_strategy(strategy, "a100x4")
    assert (c.sharding_strategy, c.offload_params, c.num_processes, c.mixed_precision) == (sharding, offload, 4, "bf16")
    assert c.cpu_ram_efficient_loading and c.sync_module_states  # GPU: rank-0 loading


def test_yaml_has_the_keys_people_meet_at_work(tmp_path):
    path = acc_cfg.write_config(acc_cfg.for_strategy("fsdp", "a100x4"), tmp_path, "fsdp")
    text = path.read_text()
    data = yaml.safe_load(text)
    fsdp = data["fsdp_config"]
    assert fsdp["fsdp_sharding_strategy"] == "FULL_SHARD"  # accelerate reads this key first (FSDP1)
    assert data["distributed_type"] == "FSDP" and data["num_processes"] == 4 and data["use_cpu"] is False
    assert fsdp["fsdp_reshard_after_forward"] == "FULL_SHARD"
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    for key in ("fsdp_offload_params", "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states"):
        assert fsdp[key] is (key != "fsdp_offload_params")
    size = acc_cfg.config_dict(acc_cfg.for_strategy("fsdp", "a100x4", auto_wrap_policy="SIZE_BASED_WRAP",
                                            min_num_params=1_000_000))["fsdp_config"]
    assert size["fsdp_min_num_params"] == 1_000_000 and "fsdp_transformer_layer_cls_to_wrap" not in size


@pytest.mark.parametrize("profile", ["a100x4", "v100x4", "smoke"])
def test_accelerate_builds_the_plugin_each_config_asks_for(profile, tmp_path):
    # accelerate's own `launch` parsing and FullyShardedDataParallelPlugin, as the ranks would see them.
    for strategy in acc_cfg.STRATEGY_MAP:
        assert acc_cfg.plugin_problems(strategy, profile, tmp_path) == []
    got = acc_cfg.resolve_plugin(acc_cfg.write_config(acc_cfg.for_strategy("fsdp-grad-op", profile), tmp_path, "g"))
    assert got["sharding_strategy"] == "SHARD_GRAD_OP"
    assert got["mixed_precision"] == {"a100x4": "bf16", "v100x4": "fp16", "smoke": "no"}[profile]


def test_only_the_new_key_would_silently_run_full_shard(tmp_path):
    # The bug this module had: fsdp_reshard_after_forward alone loses to `accelerate launch`'s
    # default --fsdp_sharding_strategy FULL_SHARD, so SHARD_GRAD_OP / NO_SHARD never ran.
    data = acc_cfg.config_dict(acc_cfg.for_strategy("fsdp-grad-op", "a100x4"))
    del data["fsdp_config"]["fsdp_sharding_strategy"]
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    assert acc_cfg.resolve_plugin(path)["sharding_strategy"] == "FULL_SHARD"


def test_cpu_profile_cannot_sync_module_states():
    c = acc_cfg.for_strategy("fsdp", "smoke")
    assert (c.sync_module_states, c.cpu_ram_efficient_loading, c.mixed_precision) == (False, False, "no")


def test_bad_values_name_the_fix():
    with pytest.raises(ConfigError, match="'ZERO3'.*FULL_SHARD"):
        acc_cfg.AccelerateFsdpConfig(sharding_strategy="ZERO3")
    with pytest.raises(ConfigError, match="needs sync_module_states=True"):
        acc_cfg.AccelerateFsdpConfig(cpu_ram_efficient_loading=True, sync_module_states=False)
    with pytest.raises(ConfigError, match="'zero2'"):
        acc_cfg.for_strategy("zero2")


def test_launch_command_and_env(tmp_path):
    cmd = acc.launch_command(tmp_path / "a.yaml", ["--steps", "2"])
    assert cmd[1:5] == ["launch", "--config_file", str(tmp_path / "a.yaml"), "-m"]
    assert cmd[0].endswith("accelerate") and cmd[5:] == ["labkit.parallel.accelerate_fsdp", "--steps", "2"]
    assert acc.launch_env("smoke")["ACCELERATE_USE_CPU"] == "1" and acc.launch_env("a100x4") == {}


def test_records_are_named_after_what_ran():
    fsdp = {"fsdp_effective": True, "distributed_type": "FSDP"}
    assert acc.record_name(fsdp, "fsdp-grad-op") == "accelerate-fsdp-grad-op"
    assert acc.record_name({"fsdp_effective": False, "distributed_type": "MULTI_CPU"}, "fsdp") == "accelerate-ddp"
    assert acc.record_name({"fsdp_effective": False, "distributed_type": "NO"}, "fsdp") == "accelerate-unsharded"


@pytest.mark.slow
def test_accelerate_on_cpu_silently_runs_ddp_and_we_say_so(tmp_path, tmp_path_factory):
    from test_sharding_memory import STEPS

    r = acc.run("fsdp", "tiny-llama", steps=STEPS, out=str(tmp_path))
    assert r.strategy == "accelerate-ddp"
    assert r.accelerate.silently_replaced is True and r.accelerate.requested_fsdp is True
    assert (r.accelerate.distributed_type, r.accelerate.wrapper) == ("MULTI_CPU", "DistributedDataParallel")
    ddp = sweep_records(tmp_path_factory)["ddp"]
    assert r.param_bytes == ddp.param_bytes  # a full replica per rank: nothing was sharded
    np.testing.assert_allclose(r.losses, ddp.losses, rtol=1e-5)
