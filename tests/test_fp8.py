"""FP8 numerics of notebook 08 (labkit.parallel.fp8): why each tensor carries a scale, and the all-gather bytes."""
from __future__ import annotations

import pytest
import torch

from labkit.errors import ConfigError


def test_formats_and_their_ranges():
    from labkit.parallel.fp8 import fp8_max

    assert fp8_max("e4m3") == 448.0 and fp8_max("e5m2") == 57344.0
    with pytest.raises(ConfigError, match="e4m3"):
        fp8_max("e3m4")


def test_small_gradients_vanish_without_a_scale_and_survive_with_one():
    from labkit.parallel.fp8 import error

    g = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 1e-6  # gradient-sized values
    raw, scaled = error(g, "e5m2", "none"), error(g, "e5m2", "tensorwise")
    assert raw["flushed_to_zero"] > 0.5 and raw["rel_error"] > 0.5
    assert scaled["flushed_to_zero"] < 0.01 and scaled["rel_error"] < 0.2
    # e4m3 has one more mantissa bit than e5m2: closer on the same (scaled) tensor
    assert error(g, "e4m3")["rel_error"] < scaled["rel_error"]


def test_rowwise_scaling_protects_rows_beside_an_outlier():
    from labkit.parallel.fp8 import error

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    x[0, 0] = 1e4  # one outlier sets the tensorwise scale for everybody
    assert error(x, "e4m3", "rowwise")["flushed_to_zero"] < error(x, "e4m3", "tensorwise")["flushed_to_zero"]
    with pytest.raises(ConfigError, match="tensorwise"):
        error(torch.ones(4), "e4m3", "rowwise")


def test_fp8_all_gather_sends_half_of_bf16():
    from labkit.parallel.fp8 import allgather_bytes
    from labkit.parallel import comm

    assert allgather_bytes(1000, 4, "fp8") == comm.bytes_sent("all_gather", 1000, 4) == 750
    assert allgather_bytes(1000, 4, "bf16") == 2 * allgather_bytes(1000, 4, "fp8")


def test_torchao_float8_training_follows_the_high_precision_run():
    from labkit.parallel.fp8 import compare_training

    out = compare_training("cpu", steps=2)
    assert out["fp8 linears"] == out["high precision linears"] == 4
    assert out["fp8"] == pytest.approx(out["high precision"], rel=0.02)
    assert out["fp8"] != out["high precision"]  # really computed in FP8: not bit-identical


def _fsdp_all_gather_inputs(fp8_all_gather: bool) -> list:
    """(dtype, bytes) of each all-gather input FSDP2 sends for a float8 MLP, rank 0 of 2 on the fake group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from labkit.parallel.fp8 import fp8_linear_filter

    mesh = init_device_mesh("cpu", (2,))
    model = torch.nn.Sequential(torch.nn.Linear(64, 256, bias=False), torch.nn.GELU(), torch.nn.Linear(256, 64, bias=False))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather),
                               module_filter_fn=fp8_linear_filter)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    seen, original = [], dist.all_gather_single

    def spy(output, inp, *args, **kwargs):  # what FSDP2's DefaultAllGather hands to c10d
        seen.append((inp.dtype, inp.numel() * inp.element_size()))
        return original(output, inp, *args, **kwargs)

    dist.all_gather_single = spy
    try:
        model(torch.randn(8, 64)).sum().backward()
    finally:
        dist.all_gather_single = original
    return seen


def test_torchao_fp8_all_gather_in_fsdp2_sends_half_the_bytes_of_bf16():
    """torchao's real FSDP2 integration (rank 0 of 2 over torch's fake process group: sizes are real) agrees
    with `allgather_bytes`: e4m3 shards, 1 byte per parameter, where bf16 mixed precision sends 2."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from labkit.parallel.fp8 import allgather_bytes

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        bf16, fp8 = _fsdp_all_gather_inputs(False), _fsdp_all_gather_inputs(True)
    finally:
        dist.destroy_process_group()
    assert {d for d, _ in bf16} == {torch.bfloat16} and {d for d, _ in fp8} == {torch.float8_e4m3fn}
    assert len(bf16) == len(fp8) > 0
    assert sum(b for _, b in fp8) * 2 == sum(b for _, b in bf16)
    # each Linear is its own FSDP unit: one all-gather of its 64 x 256 weight, half of it from each rank;
    # the formula's bytes sent per rank, (n-1)/n of the gathered fp8 weight, are that half
    assert fp8[0][1] == 64 * 256 // 2 == allgather_bytes(64 * 256, 2, "fp8")
