"""Visible tests of notebook 01_memory's code exercises (`labkit check`, `ex.check` in the notebook)."""
from labkit.course.exercises import case


@case("model_state_bytes", points=2)
def zero_paper_sixteen_bytes(model_state_bytes):
    got = model_state_bytes(7_000_000_000, "mixed-bf16", "adamw", 0, 1)
    assert got == 16 * 7_000_000_000, (
        f"mixed-precision AdamW without ZeRO: got {got:,} B for 7B parameters, expected 16 B per parameter "
        "(2 B weights + 2 B grads + 12 B fp32 master, momentum, variance)")


@case("model_state_bytes", points=1)
def zero1_shards_the_optimizer(model_state_bytes):
    got = model_state_bytes(1_000_000_000, "mixed-bf16", "adamw", 1, 4)
    assert got == 7 * 1_000_000_000, (
        f"ZeRO-1 over 4 ranks: got {got:,} B for 1B parameters; only the 12 B of optimizer states are "
        "divided by dp (2 + 2 + 12/4 = 7 B per parameter)")


def _mlp(*dims):
    import torch

    torch.manual_seed(0)
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


@case("measure_state_bytes", points=2)
def adamw_fp32_matches_torch(measure_state_bytes):
    import torch

    model = _mlp(16, 32, 8)
    n = sum(p.numel() for p in model.parameters())
    got = measure_state_bytes(model, torch.optim.AdamW(model.parameters()), torch.randn(4, 16))
    assert set(got) == {"weights", "grads", "optimizer"}, f"return a dict with keys weights, grads, optimizer; got {sorted(got)}"
    assert got["weights"] == 4 * n, f"weights: got {got['weights']:,} B, expected 4 B x {n:,} fp32 parameters"
    assert got["grads"] == 4 * n, f"grads: got {got['grads']:,} B; did the step run backward()?"
    assert 8 * n <= got["optimizer"] <= 8 * n + 64, (
        f"optimizer: got {got['optimizer']:,} B; AdamW keeps exp_avg and exp_avg_sq (2 x 4 B per parameter) "
        "plus a tiny `step` counter per tensor: count every tensor in optimizer.state")
