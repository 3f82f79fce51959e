"""Hidden tests of notebook 02_single_gpu (run by `labkit grade`; students see only pass/fail per test and VARIES).

Expected values come from plain fp32 steps computed here, in the grader's process (`reference`)."""
from labkit.course.exercises import List, Tensor, case, close, max_error, pairs, reference

#: What the hidden tests vary, per exercise: `ex.check` and `labkit check` show this line, nothing else.
VARIES = {
    "amp_accum_step": "another model, batch size and accum count, fp16 with another scale, and AdamW over two steps",
    "checkpointed_block": "a convolutional residual block with batch norm (torchvision's Bottleneck)",
}

#: Classic mistakes. (fragment, replacement, fix): a VISIBLE test must fail with `fix` in its message;
#: (fragment, replacement): any test may catch it (tests/test_exercises_ci.py checks both).
MUTANTS = {
    "amp_accum_step": [
        ("loss = F.cross_entropy(logits.float(), y) / accum", "loss = F.cross_entropy(logits.float(), y)",
         "divide each micro-batch loss by accum"),
        ("scaler.scale(loss).backward()", "loss.backward()", "backward through scaler.scale(loss)"),
        ("scaler.step(optimizer)  #", "optimizer.step()  #", "step with scaler.step(optimizer)"),
        ("    scaler.update()", "    pass", "call scaler.update()"),
        ("optimizer.zero_grad(set_to_none=True)", "pass", "zero the gradients first"),
        # a mistake of state (issue #39): its own message, not another mistake's fix
        ("        cast = torch.autocast(", "        optimizer.zero_grad(set_to_none=True)\n        cast = torch.autocast(",
         "the last micro-batch's alone"),
        ("cast = torch.autocast(x.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()",
         "cast = contextlib.nullcontext()", "run each forward under torch.autocast"),
        ("total = total + loss.detach().cpu()", "total = loss.detach().cpu()", "the sum of the micro-batch losses"),
        ("for x, y in zip(inputs.chunk(accum), targets.chunk(accum)):",
         "for x, y in zip(inputs.chunk(accum)[:1], targets.chunk(accum)[:1]):"),
    ],
    "checkpointed_block": [
        ("return checkpoint(block, x, use_reentrant=False)", "return block(x)", "torch.utils.checkpoint.checkpoint"),
        ("return checkpoint(block, x, use_reentrant=False)", "return checkpoint(block, x, use_reentrant=True)",
         "use use_reentrant=False"),
        ("return checkpoint(block, x, use_reentrant=False)", "return checkpoint(block, x.detach(), use_reentrant=False)",
         "not x.detach()"),
    ],
}


def _mlp():
    import torch

    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))


def _data(n, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _weights(model):
    import torch

    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def _full_batch(n, seed, optimizer, steps, lr):
    """REFERENCE (grader's process): `steps` plain fp32 steps on the whole batch; losses and final weights."""
    import torch
    import torch.nn.functional as F

    model = _mlp()
    opt = getattr(torch.optim, optimizer)(model.parameters(), lr=lr)
    x, y = _data(n, seed)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "weights": _weights(model)}


def _harness(amp_accum_step, n, seed, optimizer, steps, lr, accum, dtype_name, init_scale):
    import torch

    model = _mlp()
    opt = getattr(torch.optim, optimizer)(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale or 1.0, enabled=init_scale is not None)
    for p in model.parameters():
        p.grad = torch.full_like(p, -2.0)  # stale
    x, y = _data(n, seed)
    dtype = getattr(torch, dtype_name) if dtype_name else None
    losses = [float(amp_accum_step(model, x, y, opt, scaler, accum, dtype)) for _ in range(steps)]
    return {"losses": losses, "weights": _weights(model)}


RESULT = {"losses": List(float, min=1), "weights": Tensor("float32")}


@case("amp_accum_step", points=2)
def fp16_accum_3_of_12_with_another_scale(student):
    import torch

    want = reference(_full_batch, 12, 3, "SGD", 1, 0.5)
    got = student.run(_harness, 12, 3, "SGD", 1, 0.5, 3, "float16", 2.0 ** 9, returns=RESULT)
    assert abs(got["losses"][0] - want["losses"][0]) < 1e-2, (got["losses"], want["losses"])
    assert close(got["weights"], want["weights"], atol=5e-3), max_error(got["weights"], want["weights"])


@case("amp_accum_step", points=1)
def adamw_over_two_steps_with_accum_5(student):
    import torch

    want = reference(_full_batch, 10, 4, "AdamW", 2, 1e-2)
    got = student.run(_harness, 10, 4, "AdamW", 2, 1e-2, 5, None, None, returns=RESULT)
    assert all(abs(g - w) < 1e-5 for g, w in pairs(got["losses"], want["losses"], "the losses")), got["losses"]
    assert close(got["weights"], want["weights"], atol=1e-5), max_error(got["weights"], want["weights"])


def _conv_block():
    import torch
    from torchvision.models.resnet import Bottleneck

    torch.manual_seed(4)
    return Bottleneck(32, 8)


def _conv_input(requires_grad):
    import torch

    return torch.randn(2, 32, 8, 8, generator=torch.Generator().manual_seed(6)).requires_grad_(requires_grad)


def _conv_plain(requires_grad):
    """REFERENCE (grader's process): the plain Bottleneck's weight gradients."""
    block = _conv_block()
    block(_conv_input(requires_grad)).sum().backward()
    return {name: p.grad.clone() for name, p in block.named_parameters()}


def _conv_harness(checkpointed_block, requires_grad):
    from labkit.memory.sqrt_checkpointing import saved_bytes

    block, x = _conv_block(), _conv_input(requires_grad)
    out, kept = saved_bytes(checkpointed_block, block, x)
    grads = {}
    if out.requires_grad:
        out.sum().backward()
        grads = {name: p.grad for name, p in block.named_parameters() if p.grad is not None}
    return {"grads": grads, "kept": kept}


CONV = {"grads": {str: Tensor("float32")}, "kept": int}


@case("checkpointed_block", points=2)
def a_bottleneck_with_an_input_without_grad(student):
    import torch

    want = reference(_conv_plain, False)
    got = student.run(_conv_harness, False, returns=CONV)["grads"]
    assert set(got) == set(want), sorted(set(want) - set(got))
    assert close(got, want, rtol=1e-5, atol=1e-4)


@case("checkpointed_block", points=1)
def a_bottleneck_keeps_only_its_input(student):
    got = student.run(_conv_harness, True, returns=CONV)
    assert close(got["grads"], reference(_conv_plain, True), rtol=1e-5, atol=1e-4), "gradients"  # a block that trains
    assert 0 < got["kept"] <= 2 * 32 * 8 * 8 * 4, got["kept"]
