"""Hidden tests of notebook 05's exercises (run by `labkit grade`; students see only pass/fail per test and
VARIES). They reuse the visible file's checks with other inputs; expected rungs come from labkit's
estimator, computed here, never where the student's code runs."""
from labkit.course.exercises import case, reference
from labkit.course.exercises.cases import visible_twin

visible = visible_twin(__labkit_test_file__)  # noqa: F821 - set by the test loader

#: What the hidden tests vary, per exercise: `ex.check` and `labkit check` show this line, nothing else.
VARIES = {
    "pick_zero": "other models, budgets and dp sizes, and the fp32 and pure bf16 precisions",
    "make_ds_config": "other stages, dp sizes and accumulation steps, bf16 with an offloaded optimizer",
}

#: Classic mistakes. (fragment, replacement, fix): a VISIBLE test must fail with `fix` in its message;
#: (fragment, replacement): any test may catch it (tests/test_exercises_ci.py checks both).
MUTANTS = {
    "pick_zero": [
        ("budget_gib * 2**30", "budget_gib * 1e9", "a GiB is 2**30 bytes"),
        ("precision=precision", "precision='mixed-bf16'", "pass precision=precision"),
        ("dp=dp)", "dp=1)", "pass dp=dp"),
        ("    return None", "    return LADDER[-1]", "when no rung fits, return None"),
        ("for stage, offload in LADDER:", "for stage, offload in reversed(LADDER):", "the FIRST rung"),
        ("offload=offload", "offload='none'", "pass offload=offload"),
        ("<= budget_gib", "< budget_gib"),
    ],
    "make_ds_config": [
        ('"train_batch_size": micro_batch * accum * dp', '"train_batch_size": micro_batch * dp',
         "train_batch_size = micro_batch x accum x dp"),
        ('zero["offload_param"] = {"device": "cpu", "pin_memory": False}', "pass", "offload the parameters"),
        ('"bf16": {"enabled": bf16}', '"bf16": {"enabled": False}', '"bf16": {"enabled": bf16}'),
        ('"pin_memory": False', '"pin_memory": True', '"pin_memory": False'),
        ('{"lr": lr}', '{"lr": 1e-4}', "pass the lr"),
        ('if offload in ("optimizer", "optimizer+params"):', 'if offload == "optimizer":',
         "offload the optimizer's states and step"),
        ('"stage": stage', '"stage": min(stage, 2)'),
        ('"gradient_accumulation_steps": accum', '"gradient_accumulation_steps": 1'),
    ],
}


def _pick(budget, model, dp, precision):
    """The first rung of the notebook's LADDER that fits, by labkit's estimator (the grader's own)."""
    from labkit.memory.estimate import MemoryConfig, estimate

    ladder = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "optimizer"), (3, "optimizer"),
              (3, "optimizer+params")]
    for stage, offload in ladder:
        cfg = MemoryConfig(model=model, precision=precision, zero=stage, offload=offload, dp=dp)
        if estimate(cfg).model_states <= budget * 2**30:
            return stage, offload
    return None


@case("pick_zero", points=2)
def other_models_budgets_and_precisions(student):
    for args in ((16, "tinyllama-1.1b", 2, "mixed-bf16"), (8, "tinyllama-1.1b", 1, "mixed-bf16"),
                 (30, "llama2-7b", 3, "fp32"), (20, "llama2-7b", 5, "bf16"), (2, "llama2-7b", 7, "mixed-bf16"),
                 (200, "llama3-8b", 1, "mixed-bf16")):
        got, want = visible._rung(student, *args), reference(_pick, *args)
        assert got == want, f"pick_zero{args} = {got}, expected {want}"
    exact = reference(visible._model_states_gib, "llama2-7b", 4, "mixed-bf16", (1, "none"))  # fits exactly
    assert visible._rung(student, exact, "llama2-7b", 4, "mixed-bf16") == (1, "none")


@case("make_ds_config", points=2)
def other_stages_dp_and_bf16_offload(student):
    for stage, offload, kw in ((3, "optimizer", dict(dp=1, micro_batch=3, accum=4, bf16=True)),
                               (0, "none", dict(dp=1, micro_batch=1, lr=0.5)),
                               (2, "optimizer", dict(dp=8, micro_batch=1, accum=4, bf16=True)),
                               (3, "optimizer+params", dict(dp=5, micro_batch=7, accum=3))):
        visible._check_config(visible._config(student, stage, offload, **kw), stage, offload, **kw)
