"""The roofline of notebook 08 (labkit.profiling.roofline): intensities, ridge points, MFU vs HFU."""
from __future__ import annotations

import pytest

from labkit.errors import ConfigError


def test_ridge_is_peak_over_bandwidth_from_the_data_sheets():
    from labkit.profiling.roofline import ridge

    assert ridge("a100-80gb") == pytest.approx(312e12 / 2039e9)
    assert ridge("h100-sxm") == pytest.approx(989e12 / 3350e9)
    assert ridge("h100-sxm", "fp8") == pytest.approx(1979e12 / 3350e9)  # the FP8 peak: twice as far right
    with pytest.raises(ConfigError, match="a100-80gb"):
        ridge("a100")


def test_gemm_intensity_and_the_elementwise_ops_are_memory_bound():
    from labkit.profiling.roofline import layer_ops, table

    ops = {op.name: op for op in layer_ops("llama2-7b", batch=1, seq=4096)}
    q = ops["q_proj"]  # (4096 x 4096) @ (4096 x 4096), bf16: 2 m n k / (2 (mk + kn + mn)) = 4096 / 3
    assert q.flops == 2 * 4096 ** 3 and q.intensity == pytest.approx(4096 / 3)
    assert ops["softmax"].intensity == pytest.approx(5 / 4)
    rows = {r["op"]: r for r in table("llama2-7b", "a100-80gb", batch=1, seq=4096)}
    assert {r["bound"] for n, r in rows.items() if n.endswith("proj")} == {"compute"}
    assert all(rows[n]["bound"] == "memory" for n in ("softmax", "rms_norm", "swiglu", "residual_add"))
    assert rows["softmax"]["max_share_of_peak"] < 0.02
    # short sequences: the GEMMs see few tokens, their intensity falls below the ridge
    short = {r["op"]: r for r in table("llama2-7b", "h100-sxm", batch=1, seq=128)}
    assert short["q_proj"]["bound"] == "memory"


def test_full_checkpointing_makes_hfu_four_thirds_of_mfu():
    from labkit.profiling.roofline import mfu_hfu

    kw = dict(tokens=8 * 2048, seq=2048, step_s=3.0, gpus=8, peak_tflops=312.0)
    mfu, hfu = mfu_hfu("llama2-7b", checkpointing="full", **kw)
    assert hfu / mfu == pytest.approx(4 / 3, rel=0.02)  # the forward again: 8 N D of 6 N D (+ the LM head)
    assert mfu_hfu("llama2-7b", **kw)[0] == pytest.approx(mfu) and mfu_hfu("llama2-7b", **kw)[1] == pytest.approx(mfu)


def test_measure_reports_what_it_ran():
    from labkit.profiling.roofline import measure

    calls = []
    row = measure(lambda: calls.append(1), flops=100.0, nbytes=50.0, repeats=3)
    assert len(calls) == 3 and row["intensity"] == 2.0 and row["flops_per_s"] > 0
