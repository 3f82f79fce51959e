"""Checks of notebooks/08_profiling_and_stacking.ipynb: traces, the OOM playbook, and the FSDP2 + QLoRA stack.

Reading the traces and fixing an OOM are code exercises (`top_bottleneck`, `peak_cause`, `fix_oom`;
tests in notebooks/tests/08_profiling_and_stacking.py and its hidden twin), which replaced the questions
that copied a printed value (the summary's bottleneck, the playbook's last lever). Here: the
runs, the all-gathers per FSDP unit, and the NF4 shard fractions against the student's own recorded
`fsdp-qlora` run and FSDP's 1/world-size rule.
"""
from __future__ import annotations

from labkit.course.grading.checks import answer_close, answer_equals, bytes_below, cell_ran, figure_present, relation
from labkit.course.grading.evidence import Evidence

NOTEBOOK = "08_profiling_and_stacking"


def nf4_rank0(ev: Evidence) -> float:
    x = ev.run("fsdp_qlora").peft
    return x.packed_4bit_rank_bytes / x.packed_4bit_full_bytes


def ridge_h100(ev: Evidence) -> float:
    from labkit.profiling.roofline import ridge

    return ridge("h100-sxm")


def hfu_over_mfu_full(ev: Evidence) -> float:
    """The notebook's example step: ~4/3 (the forward again; the LM head is not recomputed)."""
    from labkit.profiling.roofline import mfu_hfu

    mfu, hfu = mfu_hfu("llama2-7b", tokens=8 * 4096, seq=4096, step_s=3.0, gpus=8, peak_tflops=312.0,
                       checkpointing="full")
    return hfu / mfu


def _adapters_only(ev: Evidence):
    r = ev.run("fsdp_qlora")
    total = (r.peft.total_params if r.peft else None) or 0
    ok = 0 < r.trainable_params < 0.5 * total
    return ok, f"fsdp_qlora trains {r.trainable_params:,} of {total:,} parameters"


CHECKS = (
    cell_ran("every cell ran without error", 1),
    figure_present("step-time breakdown and memory timelines shown", 1),
    relation("fsdp keeps fewer parameter bytes per rank than ddp (traced runs)", 1,
             bytes_below("param", "fsdp_traced", "ddp_traced"), reads=(("run", "fsdp_traced"), ("run", "ddp_traced"))),
    relation("fsdp-qlora trains the adapters only", 1, _adapters_only, reads=(("run", "fsdp_qlora"),)),
    answer_equals("8.1 all-gathers per FSDP unit per step", 2, "08.allgathers_per_unit_per_step", 2),
    answer_close("8.2a NF4 bytes on rank 0, as a fraction", 1, "08.nf4_fraction_rank0", nf4_rank0, rtol=0.02),
    answer_close("8.2b the same on 4 GPUs", 1, "08.nf4_fraction_4gpus", 0.25, rtol=0.02, visible=False),
    answer_close("8.3a the ridge point of an H100 SXM (bf16)", 1, "08.ridge_h100", ridge_h100, rtol=0.02),
    answer_close("8.3b HFU / MFU with full checkpointing", 1, "08.hfu_over_mfu_full", hfu_over_mfu_full, rtol=0.02),
    answer_close("8.4 FP8 all-gather bytes as a fraction of bf16's", 1, "08.fp8_allgather_fraction", 0.5,
                 rtol=0.01),
)
