"""Checks of notebooks/01_memory.ipynb: the memory exercises, against `labkit.memory.estimate`."""
from __future__ import annotations

from labkit.course.grading.checks import answer_close, cell_ran, figure_present
from labkit.course.grading.evidence import Evidence

NOTEBOOK = "01_memory"


def _states_gb(**fields) -> float:
    """Model-state GB (10^9 bytes) per GPU that labkit's estimator computes for a MemoryConfig."""
    from labkit.memory.estimate import MemoryConfig, estimate

    return estimate(MemoryConfig(**fields)).model_states / 1e9


def bytes_per_param(ev: Evidence) -> float:
    # Mixed-precision AdamW: fp16/bf16 weights and grads + fp32 master, m, v (Rajbhandari et al. 2020).
    return _states_gb(params=10**9, precision="mixed-bf16")


def zero3_7p5b_64(ev: Evidence) -> float:
    # The ZeRO paper's Figure 1: 7.5B parameters, P_os+g+p over 64 GPUs.
    return _states_gb(params=7_500_000_000, zero=3, dp=64)


def gpt3_tp8_pp8(ev: Evidence) -> float:
    # Busiest pipeline stage (it also holds the embedding), no ZeRO: dp = 1 leaves nothing to shard over.
    return _states_gb(model="gpt3-175b", tp=8, pp=8, dp=1, gpus=64)


def lora_trainable(ev: Evidence) -> float:
    from labkit.memory.estimate import MemoryConfig, estimate

    return float(estimate(MemoryConfig(model="llama2-7b", lora_rank=8)).trainable_params)


CHECKS = (
    cell_ran("every cell ran without error", 1),
    figure_present("memory bars plotted", 1),
    answer_close("1.1 bytes per parameter, mixed-precision AdamW", 2, "01.bytes_per_param_mixed_adamw",
                 bytes_per_param, rtol=0.0),
    answer_close("1.2 ZeRO-3 model states of 7.5B on 64 GPUs", 2, "01.zero3_7p5b_64gpus_gb", zero3_7p5b_64,
                 rtol=0.05),
    answer_close("1.3 GPUs for TP=8 x PP=8 x DP=8", 1, "01.gpus_tp8_pp8_dp8", 8 * 8 * 8, rtol=0.0),
    answer_close("1.4 GPT-3 175B model states per GPU at TP=8, PP=8", 3, "01.gpt3_tp8_pp8_states_gb",
                 gpt3_tp8_pp8, rtol=0.05, visible=False),
    answer_close("1.5 LoRA r=8 trainable parameters of Llama-2-7B", 2, "01.llama2_7b_lora_r8_qv_trainable",
                 lora_trainable, rtol=0.0),
)
