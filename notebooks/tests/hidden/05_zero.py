"""Hidden tests of notebook 05's exercises: more budgets and precisions, stage 3 with both offloads, bf16."""
from labkit.course.exercises import case

#: LEGACY: these exercises' tests still run in the student's process; port them to `student.call /
#: run / spawn` (docs/grading.md, "Porting a legacy exercise") and remove their names here.
LEGACY = {"pick_zero", "make_ds_config"}

MUTANTS = {
    "pick_zero": [
        ("budget_gib * 2**30", "budget_gib * 1e9"),  # GB for GiB
        ("precision=precision", "precision='mixed-bf16'"),
        ("dp=dp)", "dp=1)"),
        ("    return None", "    return LADDER[-1]"),
    ],
    "make_ds_config": [
        ('zero["offload_param"] = {"device": "cpu", "pin_memory": False}', "pass"),
        ('"bf16": {"enabled": bf16}', '"bf16": {"enabled": False}'),
        ('"train_batch_size": micro_batch * accum * dp', '"train_batch_size": micro_batch * dp'),
    ],
}


@case("pick_zero", points=2)
def other_budgets_and_precisions(pick_zero):
    scenarios = {(24, "llama2-7b", 8, "mixed-bf16"): (2, "none"),      # 23.5 GiB: fits 24 GiB, not 24 GB
                 (16, "tinyllama-1.1b", 2, "mixed-bf16"): (1, "none"),
                 (8, "tinyllama-1.1b", 1, "mixed-bf16"): (2, "optimizer"),
                 (60, "llama2-7b", 4, "fp32"): (2, "none"),            # fp32 ZeRO-1: 4 + 4 + 8/4 B/param
                 (60, "llama2-7b", 4, "mixed-bf16"): (1, "none")}
    for (budget, model, dp, precision), want in scenarios.items():
        got = pick_zero(budget, model, dp, precision)
        assert got is not None and tuple(got) == want, f"pick_zero({budget}, {model}, {dp}, {precision}) = {got}"


@case("make_ds_config", points=2)
def stage3_offload_both_and_bf16(make_ds_config):
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig(make_ds_config(3, "optimizer+params", dp=1, micro_batch=2, bf16=True))
    assert parsed.zero_optimization_stage == 3
    for name in ("offload_optimizer", "offload_param"):
        off = getattr(parsed.zero_config, name)
        assert off is not None and str(off.device).endswith("cpu") and not off.pin_memory, f"{name}: {off!r}"
    assert parsed.bfloat16_config.enabled, "bf16=True must enable bf16"
    plain = DeepSpeedConfig(make_ds_config(1, "none", dp=1, micro_batch=2))
    assert plain.zero_optimization_stage == 1
    assert plain.zero_config.offload_optimizer is None and plain.zero_config.offload_param is None
    big = make_ds_config(2, "optimizer", dp=8, micro_batch=1, accum=4)
    assert (big["train_batch_size"], big["train_micro_batch_size_per_gpu"], big["gradient_accumulation_steps"]) \
        == (32, 1, 4), big
