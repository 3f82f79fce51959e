"""FP8 numerics of notebook 08 (labkit.fp8): why each tensor carries a scale, and the all-gather bytes."""
from __future__ import annotations

import pytest
import torch

from labkit.errors import ConfigError


def test_formats_and_their_ranges():
    from labkit.fp8 import fp8_max

    assert fp8_max("e4m3") == 448.0 and fp8_max("e5m2") == 57344.0
    with pytest.raises(ConfigError, match="e4m3"):
        fp8_max("e3m4")


def test_small_gradients_vanish_without_a_scale_and_survive_with_one():
    from labkit.fp8 import error

    g = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 1e-6  # gradient-sized values
    raw, scaled = error(g, "e5m2", "none"), error(g, "e5m2", "tensorwise")
    assert raw["flushed_to_zero"] > 0.5 and raw["rel_error"] > 0.5
    assert scaled["flushed_to_zero"] < 0.01 and scaled["rel_error"] < 0.2
    # e4m3 has one more mantissa bit than e5m2: closer on the same (scaled) tensor
    assert error(g, "e4m3")["rel_error"] < scaled["rel_error"]


def test_rowwise_scaling_protects_rows_beside_an_outlier():
    from labkit.fp8 import error

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    x[0, 0] = 1e4  # one outlier sets the tensorwise scale for everybody
    assert error(x, "e4m3", "rowwise")["flushed_to_zero"] < error(x, "e4m3", "tensorwise")["flushed_to_zero"]
    with pytest.raises(ConfigError, match="tensorwise"):
        error(torch.ones(4), "e4m3", "rowwise")


def test_fp8_all_gather_sends_half_of_bf16():
    from labkit.fp8 import allgather_bytes
    from labkit.parallel import comm

    assert allgather_bytes(1000, 4, "fp8") == comm.bytes_sent("all_gather", 1000, 4) == 750
    assert allgather_bytes(1000, 4, "bf16") == 2 * allgather_bytes(1000, 4, "fp8")


def test_torchao_float8_training_follows_the_high_precision_run():
    from labkit.fp8 import compare_training

    out = compare_training("cpu", steps=2)
    assert out["fp8 linears"] == out["high precision linears"] == 4
    assert out["fp8"] == pytest.approx(out["high precision"], rel=0.02)
    assert out["fp8"] != out["high precision"]  # really computed in FP8: not bit-identical
