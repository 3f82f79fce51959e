"""Checks of notebooks/06_peft.ipynb: LoRA / QLoRA runs on one 24 GB GPU, and the exercises about them."""
from __future__ import annotations

from labkit.course.grading.checks import answer_close, answer_equals, cell_ran, fits_in, relation
from labkit.course.grading.evidence import Evidence
from labkit.memory.report import GPU_CAPACITIES

NOTEBOOK = "06_peft"
#: The scenario's RTX 4090: its device memory as nvidia-smi reports it (labkit.memory.report).
GPU_BYTES = GPU_CAPACITIES["RTX 4090 24GB"]


def _estimate(**fields):
    from labkit.memory.estimate import MemoryConfig, estimate

    return estimate(MemoryConfig(model="llama2-7b", **fields))


def lora16_all_linear(ev: Evidence) -> float:
    return float(_estimate(lora_rank=16, lora_targets=("all-linear",)).trainable_params)


def first_fit(ev: Evidence) -> str:
    """The first lever of section 1's walk whose estimate fits in 24 GB (the walk as the notebook builds it)."""
    seq = dict(batch=1, seq=512)
    lora = dict(precision="bf16", lora_rank=8, lora_targets=("q", "v"), checkpointing="full")
    walk = {"full": dict(precision="mixed-bf16"),
            "8bit-adam": dict(precision="mixed-bf16", optimizer="adamw-8bit"),
            "+ckpt": dict(precision="mixed-bf16", optimizer="adamw-8bit", checkpointing="full"),
            "lora": lora, "qlora": dict(lora, quant="nf4-dq", optimizer="paged-adamw-8bit"),
            "offload": dict(precision="mixed-bf16", zero=3, offload="optimizer+params", checkpointing="full")}
    return next(name for name, fields in walk.items() if _estimate(**seq, **fields).fits(GPU_BYTES))


def lora_fraction(ev: Evidence) -> float:
    return float(ev.run("lora").peft.trainable_fraction)


def qlora_slowdown(ev: Evidence) -> float:
    return ev.run("qlora").step_time_s / ev.run("lora").step_time_s


def adapter_bytes(ev: Evidence) -> float:
    return float(ev.run("lora").peft.adapter_bytes)


def _adapters_train_few(ev: Evidence):
    # LoRA / QLoRA train well under 1 % of a 7B model; on tiny-llama the adapters are a few percent.
    ev.run("qlora")  # both adapter runs must be there
    frac = lora_fraction(ev)
    return 0 < frac < 0.2, f"LoRA trains {frac:.2%} of the parameters"


CHECKS = (
    cell_ran("every cell ran without error", 1),
    fits_in("QLoRA fits in 24 GB", 2, "qlora", GPU_BYTES / 2**30),
    relation("adapters train a small fraction", 1, _adapters_train_few, visible=False,
             reads=(("run", "lora"), ("run", "qlora"))),
    answer_close("6.1 trainable fraction of the LoRA run", 1, "06.lora_trainable_fraction", lora_fraction,
                 rtol=0.02),
    answer_close("6.2 LoRA r=16 all-linear trainable parameters of Llama-2-7B", 2,
                 "06.llama2_7b_lora16_all_linear_params", lora16_all_linear, rtol=0.0),
    answer_close("6.3 QLoRA step time / LoRA step time", 2, "06.qlora_slowdown", qlora_slowdown, rtol=0.05),
    answer_equals("6.4 first lever that fits in 24 GB", 2, "06.first_fit_24gb", first_fit),
    answer_close("6.5 LoRA adapter size on disk", 1, "06.adapter_bytes", adapter_bytes, rtol=0.0),
)
