"""DeepSpeed ZeRO (labkit.parallel.zero): the config it writes, its records, checkpoints.

Multi-rank runs come from the shared sweep in tests/test_sharding_memory.py (one torchrun job).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from labkit.errors import ConfigError
from labkit.parallel import studies, zero
from labkit.train.api import make_config
from test_sharding_memory import sweep_records


@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    return sweep_records(tmp_path_factory)


def config(strategy: str, **options):
    cfg = make_config(strategy, "tiny-llama", nproc=2, **options)
    stage, offload = zero.VARIANTS[strategy]
    return zero.ds_config(cfg, stage, offload, dp=2, hidden=64, numel=106_816)


# ------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("strategy,stage", [("zero1", 1), ("zero2", 2), ("zero3", 3), ("zero3-offload", 3)])
def test_config_has_the_stage_and_the_batch_arithmetic(strategy, stage):
    c = config(strategy, batch=16, accum=2)
    assert c["zero_optimization"]["stage"] == stage
    assert (c["train_batch_size"], c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"]) == (16, 4, 2)
    assert c["optimizer"]["type"] == "AdamW" and c["optimizer"]["params"]["weight_decay"] == 0.0


def test_only_offload_moves_states_to_cpu_with_deepspeeds_cpu_adam():
    plain, off = config("zero3"), config("zero3-offload")
    assert "offload_optimizer" not in plain["zero_optimization"]
    assert plain["optimizer"]["params"]["torch_adam"] is True
    assert off["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert off["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert "torch_adam" not in off["optimizer"]["params"]  # DeepSpeed picks DeepSpeedCPUAdam


def test_stage3_releases_every_layer_on_cpu():
    z3 = config("zero3")["zero_optimization"]
    assert z3["stage3_max_reuse_distance"] == 0 and z3["stage3_prefetch_bucket_size"] == 0
    assert z3["stage3_param_persistence_threshold"] == 640  # only the 64-element norms stay whole
    assert "allgather_bucket_size" in config("zero2")["zero_optimization"]


def test_precision_flags_follow_amp():
    assert config("zero2", amp="bf16")["bf16"] == {"enabled": True}
    assert config("zero2")["bf16"]["enabled"] is False and config("zero2")["fp16"]["enabled"] is False


def test_bad_batch_is_a_config_error():
    cfg = make_config("zero2", "tiny-llama", nproc=2, batch=8)
    with pytest.raises(ConfigError, match="global batch 8"):
        zero.ds_config(cfg, 2, False, dp=3, hidden=64, numel=1)


def test_write_config_round_trips(tmp_path):
    path = zero.write_config(config("zero2"), tmp_path, "zero2")
    assert path == tmp_path / "ds_config_zero2.json"
    assert json.loads(path.read_text()) == config("zero2")


def test_launch_env_and_checks():
    cls = zero.ZeroStrategy
    assert cls.launch_env(make_config("zero2", "tiny-llama", nproc=2)) == {"DS_ACCELERATOR": "cpu"}
    assert cls.launch_env(make_config("zero2", "tiny-llama", nproc=2, profile="a100x4")) == {}
    with pytest.raises(ConfigError, match="--compile"):
        make_config("zero3", "tiny-llama", nproc=2, compile=True)


def test_comm_volume_stage3_is_one_and_a_half_ddp():
    assert zero.comm_bytes_per_step(2, 1000, 2) == {"reduce_scatter": 500, "all_gather": 500}
    assert sum(zero.comm_bytes_per_step(3, 1000, 2).values()) == 1500
    # accumulating 4 micro-batches: stage 2 reduce-scatters each, stage 3 gathers twice and reduces each
    assert zero.comm_bytes_per_step(2, 1000, 2, microbatches=4) == {"reduce_scatter": 2000, "all_gather": 500}
    assert sum(zero.comm_bytes_per_step(3, 1000, 2, microbatches=4).values()) == 6000


# ------------------------------------------------------------------------------------------ 2 ranks
@pytest.mark.slow
@pytest.mark.parametrize("key,stage", [("zero1", 1), ("zero2", 2), ("zero3", 3), ("zero3-offload", 3)])
def test_the_config_that_ran_is_in_the_run_folder(rec, key, stage):
    r = rec[key]
    path = Path(r.sharding.ds_config)
    assert path.name == f"ds_config_{key}.json" and path.is_file()
    assert json.loads(path.read_text())["zero_optimization"]["stage"] == stage
    assert (r.sharding.zero_stage, r.sharding.ds_accelerator) == (stage, "cpu")
    assert r.trainable_params == 106_816  # counted from ds_numel: ZeRO-3 params are empty placeholders


@pytest.mark.slow
def test_gradient_accumulation_matches_ddp(rec):
    np.testing.assert_allclose(rec["zero2-accum"].losses, rec["ddp-accum"].losses, rtol=1e-5)


@pytest.mark.slow
def test_stage3_checkpoint_resumes_to_the_same_losses(rec):
    saved, resumed = rec["zero3-save"], rec["zero3-resume"]
    assert resumed.train.resumed_from == 2
    ckpt = Path(saved.sharding.ds_config).parent / "checkpoints"
    assert any(ckpt.rglob("*optim_states.pt"))  # DeepSpeed's own per-rank partition files
    np.testing.assert_allclose(resumed.losses, rec["zero3"].losses, rtol=1e-5)


@pytest.mark.slow
def test_estimate_adds_deepspeeds_fp32_master_partition(rec):
    est = studies.estimate_for(rec["zero1"])
    assert est["ds_master_copy"] == 4 * 106_816 // 2
    assert studies.estimate_for(rec["fsdp"])["ds_master_copy"] == 0
    assert studies.estimate_for(rec["fsdp-offload"])["model_states"] == 0
