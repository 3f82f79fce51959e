"""Checks of notebooks/01_memory.ipynb: the recorded answers, against `labkit.memory.estimate`.

The code exercises (model_state_bytes, measure_state_bytes) are graded by notebooks/tests/01_memory.py and
notebooks/tests/hidden/01_memory.py (labkit.course.exercises).
"""
from __future__ import annotations

from labkit.course.grading.checks import answer_close, cell_ran, figure_present
from labkit.course.grading.evidence import Evidence

NOTEBOOK = "01_memory"


def _states_gb(**fields) -> float:
    """Model-state GB (10^9 bytes) per GPU that labkit's estimator computes for a MemoryConfig."""
    from labkit.memory.estimate import MemoryConfig, estimate

    return estimate(MemoryConfig(**fields)).model_states / 1e9


def zero3_7p5b_64(ev: Evidence) -> float:
    # The ZeRO paper's Figure 1: 7.5B parameters, P_os+g+p over 64 GPUs.
    return _states_gb(params=7_500_000_000, zero=3, dp=64)


def gpt3_tp8_pp8(ev: Evidence) -> float:
    # Busiest pipeline stage (it also holds the embedding), no ZeRO: dp = 1 leaves nothing to shard over.
    return _states_gb(model="gpt3-175b", tp=8, pp=8, dp=1, gpus=64)


CHECKS = (
    cell_ran("every cell ran without error", 1),
    figure_present("memory bars plotted", 1),
    answer_close("1.1 ZeRO-3 model states of 7.5B on 64 GPUs", 2, "01.zero3_7p5b_64gpus_gb", zero3_7p5b_64,
                 rtol=0.05),
    answer_close("1.2 GPT-3 175B model states per GPU at TP=8, PP=8", 3, "01.gpt3_tp8_pp8_states_gb",
                 gpt3_tp8_pp8, rtol=0.05, visible=False),
)
