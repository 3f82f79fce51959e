"""Checks of notebooks/05_zero.ipynb: DeepSpeed ZeRO stages 1-3 and offload, and the exercises on them.

Answers about a run are checked against the student's own recorded run; the rest against
`labkit.memory.estimate` (Rajbhandari et al. 2020's model-state arithmetic).
"""
from __future__ import annotations

from labkit.course.grading.checks import (answer_close, answer_equals, bytes_below, cell_ran, figure_present,
                                   losses_agree, relation)
from labkit.course.grading.evidence import Evidence
from labkit.memory.report import GPU_CAPACITIES

NOTEBOOK = "05_zero"
#: The scenario's RTX 4090: its device memory as nvidia-smi reports it (labkit.memory.report).
GPU_BYTES = GPU_CAPACITIES["RTX 4090 24GB"]


def _estimate(**fields):
    from labkit.memory.estimate import MemoryConfig, estimate

    return estimate(MemoryConfig(**fields))


def paper_stage3_gb(ev: Evidence) -> float:
    # The ZeRO paper's Figure 1: 7.5B parameters, mixed-precision Adam (K = 12), P_os+g+p over 64 GPUs.
    return _estimate(params=7_500_000_000, precision="mixed-fp16", zero=3, dp=64).model_states / 1e9


def zero2_grad_ratio(ev: Evidence) -> float:
    return ev.run("zero2").grad_bytes[0] / ev.run("ddp").grad_bytes[0]


def zero1_master_bytes(ev: Evidence) -> float:
    return float(ev.run("zero1").memory.master_copy_bytes)


def zero2_fsdp_name(ev: Evidence) -> str:
    # FSDP1's sharding_strategy for ZeRO stage 2, from the estimator's own table.
    from labkit.memory.config import FSDP_STRATEGIES

    return next(name for name, stage in FSDP_STRATEGIES.items() if stage == 2).upper()


def zero3_offload_host_bytes(ev: Evidence) -> float:
    return float(ev.run("zero3-offload").cpu_offload_bytes[0])


def fits_on_4090() -> list[str]:
    """labkit strategies whose estimated model states of a Llama-2-7B full fine-tune (mixed-bf16 AdamW,
    one GPU) fit in 24 GB. fsdp-offload counts as zero3-offload: CPUOffloadPolicy keeps at least the
    same bytes on the host (notebook 05's FSDP <-> ZeRO table)."""
    from labkit.parallel.studies import ESTIMATE_FIELDS

    fits = []
    for name, fields in ESTIMATE_FIELDS.items():
        fields = ESTIMATE_FIELDS["zero3-offload"] if name == "fsdp-offload" else fields
        if _estimate(model="llama2-7b", precision="mixed-bf16", dp=1, **fields).model_states <= GPU_BYTES:
            fits.append(name)
    return fits


def host_gb_4090(ev: Evidence) -> float:
    est = _estimate(model="llama2-7b", precision="mixed-bf16", zero=3, dp=1, offload="optimizer+params")
    return est.cpu_bytes / 1e9


def _strategy_fits(ev: Evidence):
    got = ev.answer("05.llama7b_4090_strategy")
    ok = isinstance(got, str) and got.strip().lower() in fits_on_4090()
    return ok, f"answer {got!r} {'fits' if ok else 'does not fit'} a 7B full fine-tune in 24 GB by the estimator"


CHECKS = (
    cell_ran("every cell ran without error", 1),
    figure_present("ZeRO stages compared in a figure", 1),
    relation("zero2 keeps fewer gradient bytes per rank than ddp", 1, bytes_below("grad", "zero2", "ddp"),
             reads=(("run", "zero2"), ("run", "ddp"))),
    relation("zero3 keeps fewer parameter bytes per rank than ddp", 1, bytes_below("param", "zero3", "ddp"),
             reads=(("run", "zero3"),)),
    relation("zero3 trains with ddp's losses", 1, losses_agree("zero3", "ddp", 0.02), visible=False,
             reads=(("run", "zero3"), ("run", "ddp"))),
    answer_close("5.1 ZeRO paper: stage-3 model states per GPU", 2, "05.paper_stage3_gb", paper_stage3_gb,
                 rtol=0.05),
    answer_close("5.2 zero2 / ddp gradient bytes on rank 0", 2, "05.zero2_grad_ratio", zero2_grad_ratio, rtol=0.01),
    answer_close("5.3 fp32 master partition of the zero1 run", 1, "05.zero1_master_bytes", zero1_master_bytes,
                 rtol=0.0),
    answer_equals("5.4 FSDP1 sharding_strategy of ZeRO stage 2", 1, "05.zero2_fsdp_strategy", zero2_fsdp_name),
    answer_close("5.5 host bytes of the zero3-offload run", 1, "05.zero3_offload_host_bytes",
                 zero3_offload_host_bytes, rtol=0.0),
    relation("5.6a strategy that fits Llama-2-7B on one 24 GB GPU", 2, _strategy_fits,
             reads=(("answer", "05.llama7b_4090_strategy"),)),
    answer_close("5.6b host GB it needs", 2, "05.llama7b_4090_host_gb", host_gb_4090, rtol=0.05),
)
