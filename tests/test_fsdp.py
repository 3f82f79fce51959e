"""FSDP2 (labkit.parallel.fsdp) and memory-efficient loading (labkit.parallel.loading).

Multi-rank runs come from the shared sweep in tests/test_sharding_memory.py (one torchrun job).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from labkit.errors import ConfigError
from labkit.facts import CommFacts
from labkit.parallel import fsdp, loading
from test_sharding_memory import sweep_records, wrap_rows


@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    return sweep_records(tmp_path_factory)


@pytest.fixture(scope="module")
def llama():
    from labkit.zoo.models import build_llm
    return build_llm("tiny-llama", seed=0)


# ------------------------------------------------------------------------------------------ pure parts
def test_mesh_shapes_map_the_sharding_strategies():
    assert fsdp.mesh_shape(fsdp.VARIANTS["fsdp"], 8) == ((8,), ("dp_shard",))
    assert fsdp.mesh_shape(fsdp.VARIANTS["fsdp-no-shard"], 8) == ((8, 1), ("dp_replicate", "dp_shard"))
    assert fsdp.mesh_shape(fsdp.VARIANTS["fsdp-hybrid"], 8, nnodes=2) == ((2, 4), ("dp_replicate", "dp_shard"))
    with pytest.raises(ConfigError, match="do not split into 3 nodes"):
        fsdp.mesh_shape(fsdp.VARIANTS["fsdp-hybrid"], 8, nnodes=3)


def test_plan_rejects_unknown_values():
    with pytest.raises(ConfigError, match="'diagonal'"):
        fsdp.FsdpPlan(mesh="diagonal")
    with pytest.raises(ConfigError, match="'per-layer'.*block"):
        fsdp.plan_for("fsdp", wrap="per-layer")
    with pytest.raises(ConfigError, match="min_num_params=0"):
        fsdp.FsdpPlan(wrap="size", min_num_params=0)


def test_block_wrap_makes_one_unit_per_decoder_layer(llama):
    units = fsdp.wrap_units(llama, "block")
    assert [type(u).__name__ for u in units] == ["LlamaDecoderLayer"] * 2
    sizes = fsdp.unit_sizes(llama, units)
    assert sum(sizes) == sum(p.numel() for p in llama.parameters())
    assert sizes[-1] == 2 * 256 * 64 + 64  # the root keeps embedding, LM head and final norm


def test_size_wrap_follows_min_num_params(llama):
    units = fsdp.wrap_units(llama, "size", min_num_params=20_000)
    sizes = fsdp.unit_sizes(llama, units)
    assert units and all(s >= 20_000 for s in sizes[:-1])
    assert sum(sizes) == sum(p.numel() for p in llama.parameters())
    finer = fsdp.wrap_units(llama, "size", min_num_params=5_000)
    assert len(finer) > len(units)
    assert fsdp.wrap_units(llama, "root") == []


def test_size_wrap_keeps_tied_embedding_in_the_root():
    from transformers import LlamaConfig, LlamaForCausalLM
    from labkit.zoo.presets import LLM_PRESETS

    tied = LlamaForCausalLM(LlamaConfig(**{**LLM_PRESETS["tiny-llama"], "tie_word_embeddings": True}))
    units = fsdp.wrap_units(tied, "size", min_num_params=1_000)
    assert units and all(tied.model.embed_tokens.weight is not p for u in units for p in u.parameters())


def test_comm_volume_of_each_variant():
    psi = 1000
    assert fsdp.comm_bytes_per_step(fsdp.VARIANTS["fsdp"], psi, (2,)) == {"all_gather": 1000, "reduce_scatter": 500}
    assert fsdp.comm_bytes_per_step(fsdp.VARIANTS["fsdp-grad-op"], psi, (2,))["all_gather"] == 500
    hybrid = fsdp.comm_bytes_per_step(fsdp.VARIANTS["fsdp-hybrid"], psi, (2, 4))
    assert hybrid["all_reduce"] == int(2 * 1 / 2 * psi / 4)


def test_policies_for_cpu():
    assert fsdp.offload_policy_for(fsdp.VARIANTS["fsdp-offload"], torch.device("cpu")).pin_memory is False
    mp = fsdp.mp_policy_for("bf16")
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp.mp_policy_for("none").param_dtype is None


def test_fsdp_refuses_an_image_model():
    from labkit.train.api import make_config
    with pytest.raises(ConfigError, match="tiny-resnet"):
        make_config("fsdp", "tiny-resnet", nproc=2)


def test_rank0_loading_builds_nothing_on_other_ranks():
    meta = loading.build_on_rank0("tiny-llama", rank=1)
    real = loading.build_on_rank0("tiny-llama", rank=0, seed=0)
    assert loading.has_meta(meta) and not loading.has_meta(real)
    assert all(p.device.type == "meta" for p in meta.parameters())
    with pytest.raises(ConfigError, match="tiny-resnet"):
        loading.build_on_rank0("tiny-resnet", rank=0)


# ------------------------------------------------------------------------------------------ 2 ranks
@pytest.mark.slow
def test_accumulation_matches_ddp(rec):
    np.testing.assert_allclose(rec["fsdp-accum"].losses, rec["ddp-accum"].losses, rtol=1e-5)


@pytest.mark.slow
def test_checkpoint_folder_loaded_on_rank0_only_matches_ddp(rec):
    assert rec["fsdp-ckpt"].sharding.memory_efficient_loading is True
    np.testing.assert_allclose(rec["fsdp-ckpt"].losses, rec["ddp-ckpt"].losses, rtol=1e-5)


@pytest.mark.slow
def test_bf16_mixed_precision_keeps_fp32_masters(rec):
    r = rec["fsdp-bf16"]
    assert (r.sharding.param_dtype, r.sharding.reduce_dtype, r.sharding.master_dtype) == ("bfloat16", "float32", "float32")
    assert r.param_bytes == rec["fsdp"].param_bytes  # the sharded masters stay fp32: same bytes
    np.testing.assert_allclose(r.losses, rec["fsdp"].losses, rtol=2e-2)


@pytest.mark.slow
def test_records_describe_the_mesh(rec):
    assert rec["fsdp-no-shard"].sharding.mesh_shape == [2, 1]
    assert rec["fsdp-hybrid"].sharding.mesh_shape == [1, 2]
    assert rec["fsdp-grad-op"].sharding.reshard_after_forward is False
    assert rec["fsdp-grad-op"].memory.param_bytes_after_forward == max(rec["ddp"].param_bytes)
    assert rec["fsdp"].sharding.fsdp_units == 3
    # Full shard: all-gather in forward and backward, reduce-scatter once, each (N-1)/N of the fp32 params.
    full = max(rec["ddp"].param_bytes)
    assert rec["fsdp"].comm == CommFacts(all_gather=full, reduce_scatter=full // 2)
    assert rec["fsdp"].comm.total == 1.5 * rec["ddp"].comm.total


@pytest.mark.slow
def test_finer_wrapping_gathers_less_at_once(tmp_path_factory):
    rows = wrap_rows(tmp_path_factory)
    full = 4 * 106_816
    assert rows["root"]["units"] == 1 and rows["root"]["peak_param_bytes"] == full
    assert rows["block"]["shard_bytes"] == rows["size"]["shard_bytes"] == full // 2
    assert rows["size"]["peak_param_bytes"] < rows["block"]["peak_param_bytes"] < full
