"""Visible tests of notebook 02_single_gpu's code exercises (`labkit check`, `ex.check` in the notebook)."""
from labkit.course.exercises import case

#: LEGACY: these exercises' tests still run in the student's process; port them to `student.call /
#: run / spawn` (docs/grading.md, "Porting a legacy exercise") and remove their names here.
LEGACY = {"amp_accum_step", "checkpointed_block"}


def _mlp(seed=0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _data(n=16, seed=1):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _reference(x, y, lr=0.1):
    """The fp32 full-batch SGD step: (model after the step, loss)."""
    import torch
    import torch.nn.functional as F

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return model, float(loss)


def _step(amp_accum_step, x, y, accum, dtype, scaler=None, lr=0.1):
    import torch

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = scaler or torch.amp.GradScaler("cpu", enabled=False)
    loss = amp_accum_step(model, x, y, opt, scaler, accum, dtype)
    return model, loss


def _max_param_diff(a, b):
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


@case("amp_accum_step", points=2)
def fp32_accum_equals_the_full_batch_step(amp_accum_step):
    x, y = _data()
    ref, ref_loss = _reference(x, y)
    model, loss = _step(amp_accum_step, x, y, accum=4, dtype=None)
    assert loss is not None, "return the mean loss of the batch (detached)"
    assert abs(float(loss) - ref_loss) < 1e-5, (
        f"returned loss {float(loss):.6f}, the full batch's mean loss is {ref_loss:.6f}: return the sum of the "
        "micro-batch losses, each divided by accum")
    diff = _max_param_diff(model, ref)
    assert diff < 1e-5, (
        f"after the step the weights differ from one fp32 step on the whole batch by {diff:.2e}: divide each "
        "micro-batch loss by accum, backward every micro-batch, then one optimizer step")


@case("amp_accum_step", points=1)
def bf16_autocast_stays_close_to_fp32(amp_accum_step):
    import torch

    x, y = _data()
    ref, ref_loss = _reference(x, y)
    model, loss = _step(amp_accum_step, x, y, accum=2, dtype=torch.bfloat16)
    assert abs(float(loss) - ref_loss) < 0.05, f"bf16 loss {float(loss):.4f} vs fp32 {ref_loss:.4f}"
    diff = _max_param_diff(model, ref)
    assert diff < 2e-3, f"bf16 step differs from the fp32 step by {diff:.2e} in the weights (expected < 2e-3)"
    assert all(p.dtype == torch.float32 for p in model.parameters()), "autocast must leave the weights fp32"


def _block(seed=0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 32))


@case("checkpointed_block", points=2)
def gradients_equal_the_plain_block(checkpointed_block):
    import torch

    block = _block()
    x = torch.randn(16, 32, requires_grad=True)
    block(x).square().sum().backward()
    want = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    out = checkpointed_block(block, x)
    assert torch.allclose(out, block(x)), "the output must equal block(x)"
    out.square().sum().backward()
    got = [p.grad for p in block.parameters()] + [x.grad]
    assert all(g is not None and torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want)), (
        "gradients of the weights and the input differ from the plain block's")


@case("checkpointed_block", points=2)
def keeps_far_less_for_backward(checkpointed_block):
    import torch

    from labkit.memory.sqrt_checkpointing import saved_bytes

    block = _block()
    x = torch.randn(64, 32, requires_grad=True)
    _, plain = saved_bytes(block, x)
    _, kept = saved_bytes(checkpointed_block, block, x)
    assert kept <= plain / 4, (
        f"autograd saved {kept:,} B for backward, the plain block {plain:,} B: a checkpointed block keeps only "
        "its input (torch.utils.checkpoint.checkpoint)")
