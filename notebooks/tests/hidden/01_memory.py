"""Hidden tests of notebook 01_memory (run by `labkit grade`; students see only pass/fail per test and VARIES).

Expected values come from labkit's estimator, computed in the grader's process (`reference`), never where
the student's code runs."""
from labkit.course.exercises import case, reference

#: What the hidden tests vary, per exercise: `ex.check` and `labkit check` show this line, nothing else.
VARIES = {
    "model_state_bytes": "other parameter counts, mixed-fp16, and ZeRO stages over dp sizes that do not divide",
    "measure_state_bytes": "frozen layers (no grads, no optimizer states) and plain SGD",
}

#: Classic mistakes. (fragment, replacement, fix): a VISIBLE test must fail with `fix` in its message;
#: (fragment, replacement): any test may catch it (tests/test_exercises_ci.py checks both).
MUTANTS = {
    "model_state_bytes": [
        ('master = 4 if precision.startswith("mixed") else 0', "master = 0", "count the fp32 master copy"),
        ("if zero_stage >= stage:", "if zero_stage > stage:", "ZeRO-1 divides the optimizer states"),
        ('"adamw": 2,', '"adamw": 1,', "AdamW keeps two states per parameter"),
        ('state = 4 if master or precision == "fp32" else weight', "state = weight", "AdamW's states are fp32"),
        ('state = 4 if master or precision == "fp32" else weight', "state = 4",
         "keeps the optimizer states in bf16"),
        ('"sgd-momentum": 1,', '"sgd-momentum": 2,', "one buffer per parameter"),
        ("math.ceil(parts[part] / dp)", "parts[part] // dp", "round each divided part up"),
        ('(2, "grads")', '(3, "grads")', "ZeRO-2 also divides the gradients"),
        ('"mixed-fp16": 2}', '"mixed-fp16": 4}'),
    ],
    "measure_state_bytes": [
        ("optimizer.step()", "pass", "call optimizer.step()"),
        ("for v in s.values() if torch.is_tensor(v)", "for v in list(s.values())[:1] if torch.is_tensor(v)",
         "count every tensor in optimizer.state"),
        ("return t.numel() * t.element_size()", "return t.numel() * 4", "element_size() is 2 for bf16"),
        ("if p.grad is not None", "if True"),
        ("sum(size(p.grad) for p in model.parameters() if p.grad is not None)",
         "sum(size(p) for p in model.parameters())", "a frozen parameter has no .grad"),
    ],
}


def _estimate(params, precision, optimizer, zero, dp):
    from labkit.memory.estimate import MemoryConfig, estimate

    return estimate(MemoryConfig(params=params, precision=precision, optimizer=optimizer, zero=zero,
                                 dp=dp)).model_states


@case("model_state_bytes", points=3)
def agrees_with_the_estimator(student):
    grid = [(7_500_000_000, "mixed-bf16", "adamw", 3, 64), (1_234_567, "fp32", "adamw", 2, 3),
            (6_738_415_616, "bf16", "adamw", 0, 1), (999_999, "mixed-fp16", "sgd-momentum", 1, 7),
            (10**9, "fp16", "sgd", 3, 8), (3_000_001, "fp32", "sgd-momentum", 2, 5)]
    for args in grid:
        got, want = student.call(*args, returns=int), reference(_estimate, *args)
        assert got == want, f"{args}: got {got}, expected {want}"


@case("model_state_bytes", points=1)
def zero_paper_figure_1(student):
    # 7.5B parameters, P_os+g+p over 64 GPUs: 120 GB / 64 = 1.875 GB (Rajbhandari et al. 2020, Fig. 1).
    assert student.call(7_500_000_000, "mixed-bf16", "adamw", 3, 64, returns=int) == 1_875_000_000


def _frozen_mlp():
    import torch

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4))
    model[0].requires_grad_(False)
    return model


STATES = {"weights": int, "grads": int, "optimizer": int}


@case("measure_state_bytes", points=2)
def frozen_layers_have_no_grads_or_states(student):
    import torch

    model = _frozen_mlp()
    total = sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in trainable)
    got = student.call(model, torch.optim.AdamW(trainable, lr=1e-3), torch.randn(3, 8), returns=STATES)
    assert got == {"weights": 4 * total, "grads": 4 * n, "optimizer": 8 * n + 4 * len(trainable)}, got


@case("measure_state_bytes", points=1)
def plain_sgd_keeps_no_state(student):
    import torch

    torch.manual_seed(2)
    model = torch.nn.Linear(32, 16)
    n = sum(p.numel() for p in model.parameters())
    got = student.call(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(5, 32), returns=STATES)
    assert got == {"weights": 4 * n, "grads": 4 * n, "optimizer": 0}, got
