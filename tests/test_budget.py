"""labkit.parallel.budget: 6 N D, the Chinchilla count, and the planner's layouts ranked by cost (planner.budget)."""
from __future__ import annotations

import pytest

from labkit.parallel import budget as B
from labkit.parallel import planner
from labkit.errors import ConfigError
from labkit.memory.params import model_spec
from labkit.parallel.perf_model import GPUS


def test_six_n_d_and_chinchilla():
    assert B.training_flops(175e9, 300e9) == pytest.approx(3.15e23)
    assert B.chinchilla_tokens(70e9) == pytest.approx(1.4e12)  # Chinchilla itself: 70B on 1.4T tokens
    # 1024 GPUs x 312 TFLOPS x MFU 0.5 = 1.6e17 FLOP/s: 3.15e23 FLOPs in ~22.8 days
    assert B.days_at_mfu(175e9, 300e9, 1024, 312, 0.5) == pytest.approx(3.15e23 / (1024 * 312e12 * 0.5) / 86400)
    with pytest.raises(ConfigError, match="mfu=1.5"):
        B.days_at_mfu(175e9, 300e9, 1024, 312, 1.5)


def test_ranked_layouts_fit_are_sorted_and_agree_with_six_n_d():
    rows = B.rank_by_cost("gpt3-175b", 300e9, (64, 256), price_per_gpu_hour=2.0)
    costs = [r.budget.cost for r in rows]
    assert costs == sorted(costs) and {r.gpus for r in rows} == {64, 256}
    assert all(r.memory_gb <= planner.USABLE * 80 for r in rows)  # the planner's usable share of 80 GB
    best = rows[0].budget
    assert best.cost == pytest.approx(best.gpu_hours * 2.0)
    # the planner's model FLOPs include attention and the LM head: 6 N D at its MFU is a few % faster
    n = model_spec("gpt3-175b").params
    six_nd_days = B.days_at_mfu(n, 300e9, rows[0].gpus, GPUS["a100-80gb"].peak_tflops, best.mfu)
    assert six_nd_days == pytest.approx(best.days, rel=0.06) and six_nd_days < best.days
    assert rows[0].to_dict()["cost"] == round(best.cost)
    assert "GPU-hours" in B.format_rows(rows, top=3) and len(B.format_rows(rows, top=3).splitlines()) == 4


def test_no_fitting_layout_says_so():
    with pytest.raises(ConfigError, match="no layout of gpt3-175b fits"):
        B.rank_by_cost("gpt3-175b", 300e9, (8,))


def test_lora_step_flops_are_four_n_frozen_plus_six_n_trained():
    n = model_spec("llama2-7b").params
    assert B.finetune_flops(n, 0, 1) == pytest.approx(2 / 3 * B.training_flops(n, 1))
    assert B.finetune_flops(0, n, 10) == B.training_flops(n, 10)  # nothing frozen: the 6 N D rule
    assert B.finetune_flops(n - 4_194_304, 4_194_304, 2048) < 0.67 * B.training_flops(n, 2048)
