"""Hidden tests of notebook 02_single_gpu (run by `labkit grade`; students see only pass/fail per test)."""
from labkit.course.exercises import case

#: LEGACY: these exercises' tests still run in the student's process; port them to `student.call /
#: run / spawn` (docs/grading.md, "Porting a legacy exercise") and remove their names here.
LEGACY = {"amp_accum_step", "checkpointed_block"}

MUTANTS = {
    "amp_accum_step": [
        ("loss = F.cross_entropy(logits.float(), y) / accum", "loss = F.cross_entropy(logits.float(), y)"),
        ("scaler.scale(loss).backward()", "loss.backward()"),
        ("scaler.step(optimizer)  #", "optimizer.step()  #"),
        ("    scaler.update()", "    pass"),
        ("optimizer.zero_grad(set_to_none=True)", "pass"),
        ("cast = torch.autocast(x.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()",
         "cast = contextlib.nullcontext()"),
    ],
    "checkpointed_block": [
        ("return checkpoint(block, x, use_reentrant=False)", "return block(x)"),
        ("return checkpoint(block, x, use_reentrant=False)", "return checkpoint(block, x, use_reentrant=True)"),
    ],
}


def _mlp(seed=0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))


def _data(n, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _reference(x, y, lr):
    import torch
    import torch.nn.functional as F

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return model, float(loss)


def _diff(a, b):
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


@case("amp_accum_step", points=2)
def fp16_with_a_scaler_unscales_before_the_step(amp_accum_step):
    import torch

    x, y = _data(12, 3)
    ref, _ = _reference(x, y, lr=0.5)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    amp_accum_step(model, x, y, opt, scaler, 3, torch.float16)
    assert _diff(model, ref) < 5e-3
    assert all(p.dtype == torch.float32 for p in model.parameters())


@case("amp_accum_step", points=2)
def an_overflow_skips_the_step_and_halves_the_scale(amp_accum_step):
    import torch

    x, y = _data(8, 4)
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    amp_accum_step(model, x * 1e6, y, opt, scaler, 2, torch.float16)  # fp16 overflows: inf gradients
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "step not skipped"
    assert scaler.get_scale() == 2.0 ** 15, "scale not halved"


@case("amp_accum_step", points=1)
def stale_gradients_are_cleared_and_a_second_step_matches(amp_accum_step):
    import torch
    import torch.nn.functional as F

    x, y = _data(8, 5)
    ref = _mlp()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = []
    for _ in range(2):
        ropt.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        ropt.step()
        want.append(float(loss))
    model = _mlp()
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)  # left over from an earlier step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    got = [float(amp_accum_step(model, x, y, opt, scaler, 2, None)) for _ in range(2)]
    assert all(abs(g - w) < 1e-5 for g, w in zip(got, want)), (got, want)
    assert _diff(model, ref) < 1e-5


@case("amp_accum_step", points=1)
def autocast_really_runs_the_matmuls_in_bf16(amp_accum_step):
    import torch

    seen = []
    model = _mlp()
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    x, y = _data(4, 6)
    amp_accum_step(model, x, y, torch.optim.SGD(model.parameters(), lr=0.1),
                   torch.amp.GradScaler("cpu", enabled=False), 2, torch.bfloat16)
    assert seen == [torch.bfloat16, torch.bfloat16], seen


def _conv_block(seed=0):
    import torch
    from torchvision.models.resnet import Bottleneck

    torch.manual_seed(seed)
    return Bottleneck(32, 8)


@case("checkpointed_block", points=2)
def an_input_without_grad_still_gives_weight_gradients(checkpointed_block):
    import torch

    block = _conv_block()
    x = torch.randn(2, 32, 8, 8)  # e.g. the output of a frozen stem: no requires_grad
    block(x).sum().backward()
    want = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    checkpointed_block(block, x).sum().backward()
    assert all(p.grad is not None and torch.allclose(p.grad, w, atol=1e-4)
               for p, w in zip(block.parameters(), want))


@case("checkpointed_block", points=1)
def a_residual_block_keeps_only_its_input(checkpointed_block):
    import torch

    from labkit.memory.sqrt_checkpointing import saved_bytes

    block = _conv_block(1)
    x = torch.randn(4, 32, 8, 8, requires_grad=True)
    _, kept = saved_bytes(checkpointed_block, block, x)
    assert kept <= x.numel() * x.element_size()
