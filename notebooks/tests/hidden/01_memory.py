"""Hidden tests of notebook 01_memory (run by `labkit grade`; students see only pass/fail per test)."""
from labkit.course.exercises import case

MUTANTS = {
    "model_state_bytes": [
        ('master = 4 if precision.startswith("mixed") else 0', "master = 0"),
        ("if zero_stage >= stage:", "if zero_stage > stage:"),
        ('"adamw": 2,', '"adamw": 1,'),
        ("state = 4 if master or precision == \"fp32\" else weight", "state = weight"),
    ],
    "measure_state_bytes": [
        ("optimizer.step()", "pass"),
        ("if p.grad is not None", "if True"),
        ("for v in s.values() if torch.is_tensor(v)", "for v in list(s.values())[:1] if torch.is_tensor(v)"),
    ],
}


def _estimate(params, precision, optimizer, zero, dp):
    from labkit.memory.estimate import MemoryConfig, estimate

    return estimate(MemoryConfig(params=params, precision=precision, optimizer=optimizer, zero=zero,
                                 dp=dp)).model_states


@case("model_state_bytes", points=3)
def agrees_with_the_estimator(model_state_bytes):
    grid = [(7_500_000_000, "mixed-bf16", "adamw", 3, 64), (1_234_567, "fp32", "adamw", 2, 3),
            (6_738_415_616, "bf16", "adamw", 0, 1), (999_999, "mixed-fp16", "sgd-momentum", 1, 7),
            (10**9, "fp16", "sgd", 3, 8), (3_000_001, "fp32", "sgd-momentum", 2, 5)]
    for args in grid:
        got, want = model_state_bytes(*args), _estimate(*args)
        assert got == want, f"{args}: got {got}, expected {want}"


@case("model_state_bytes", points=1)
def zero_paper_figure_1(model_state_bytes):
    # 7.5B parameters, P_os+g+p over 64 GPUs: 120 GB / 64 = 1.875 GB (Rajbhandari et al. 2020, Fig. 1).
    assert model_state_bytes(7_500_000_000, "mixed-bf16", "adamw", 3, 64) == 1_875_000_000


def _frozen_mlp():
    import torch

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4))
    model[0].requires_grad_(False)
    return model


@case("measure_state_bytes", points=2)
def frozen_layers_have_no_grads_or_states(measure_state_bytes):
    import torch

    model = _frozen_mlp()
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    got = measure_state_bytes(model, opt, torch.randn(3, 8))
    assert got["weights"] == 4 * total and got["grads"] == 4 * trainable
    assert 8 * trainable <= got["optimizer"] <= 8 * trainable + 64


@case("measure_state_bytes", points=1)
def sgd_momentum_and_bf16(measure_state_bytes):
    import torch

    torch.manual_seed(2)
    model = torch.nn.Linear(32, 16).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    got = measure_state_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                              torch.randn(5, 32, dtype=torch.bfloat16))
    assert got == {"weights": 2 * n, "grads": 2 * n, "optimizer": 2 * n}
