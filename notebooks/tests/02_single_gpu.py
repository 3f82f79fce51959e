"""Visible tests of notebook 02_single_gpu's code exercises (`ex.check` in the notebook, `labkit check`, `labkit grade`).

A harness below runs your function in its own process and returns only what it produced (the loss, the
gradients and weights after the step, the scaler's scale, what autograd saved); the expected values are
computed here, in the grader's process, from one plain fp32 step on the whole batch. Gradients are checked
after ONE SGD step, so a scale error shows. Every convention a test checks is in the exercise's docstring.
"""
from labkit.course.exercises import ANY, Either, Float, Tensor, case, max_error, reference
from labkit.course.exercises.expect import conform
from labkit.course.exercises.student import StudentError

LR = 0.1


def _mlp():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _data(n=16):
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _named(model, what):
    return {name: (p.grad if what == "grads" else p).detach().clone() for name, p in model.named_parameters()
            if what != "grads" or p.grad is not None}


def _full_batch(lr, accum):
    """REFERENCE (grader's process): one fp32 SGD step on the whole batch; the micro-batch losses too."""
    import torch
    import torch.nn.functional as F

    model = _mlp()
    start = _named(model, "weights")
    x, y = _data()
    with torch.no_grad():
        micro = [float(F.cross_entropy(model(xb), yb)) for xb, yb in zip(x.chunk(accum), y.chunk(accum))]
    last = _mlp()  # what zero_grad inside the micro-batch loop leaves: the last micro-batch's gradient only
    (F.cross_entropy(last(x.chunk(accum)[-1]), y.chunk(accum)[-1]) / accum).backward()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = _named(model, "grads")
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return {"loss": loss.item(), "micro": micro, "grads": grads, "weights": _named(model, "weights"), "start": start,
            "last": _named(last, "grads")}


def _step_harness(amp_accum_step, accum, dtype_name, init_scale, lr, stale, input_scale):
    """HARNESS (the student's process): a fresh model, SGD and GradScaler; one call of your step; what it did."""
    import torch

    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale or 1.0, enabled=init_scale is not None)
    if stale is not None:
        for p in model.parameters():
            p.grad = torch.full_like(p, stale)  # left over from an earlier step
    seen = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(str(out.dtype).removeprefix("torch.")))
    x, y = _data()
    loss = amp_accum_step(model, x * input_scale, y, optimizer, scaler, accum,
                          getattr(torch, dtype_name) if dtype_name else None)
    return {"loss": None if loss is None else float(loss.detach() if torch.is_tensor(loss) else loss), "grads": _named(model, "grads"),
            "weights": _named(model, "weights"), "scale": float(scaler.get_scale()) if init_scale else 1.0,
            "forward_dtypes": seen}


#: After an overflow the loss and the gradients hold inf (that is the test), so they may be non-finite here.
STEP = {"loss": Either(Float(finite=False), None), "grads": {str: Tensor(finite=False)},
        "weights": {str: Tensor("float32")}, "scale": float,
        "forward_dtypes": [str]}

#: torch's GradScaler refuses a step taken the wrong way; what each refusal means in this exercise.
SCALER_REFUSALS = {
    "_scale is None": "scaler.step found no scaled gradients: backward through scaler.scale(loss), not loss.backward()",
    "No inf checks were recorded": "scaler.update() found no step to check: step with scaler.step(optimizer), "
                                   "which unscales the gradients first and skips a step with inf, not optimizer.step()",
}


def _step(student, accum, dtype_name=None, init_scale=None, lr=LR, stale=None, input_scale=1.0):
    try:
        return student.run(_step_harness, accum, dtype_name, init_scale, lr, stale, input_scale, returns=STEP)
    except StudentError as exc:
        fix = next((fix for needle, fix in SCALER_REFUSALS.items() if needle in exc.message), None)
        if fix is None:
            raise
        raise AssertionError(f"{exc.label} raised {exc.kind} ({exc.message[:120]}): {fix}") from None


def _close(a, b, rtol, atol):
    import torch

    return a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol))


def _ratio(got: dict, want: dict) -> float:
    import torch

    return float(torch.cat([got[k].float().reshape(-1) for k in want]).norm() /
                 torch.cat([w.reshape(-1) for w in want.values()]).norm())


def _grad_problem(got: dict, want: dict, what: str, accum: int, rtol=1e-4, atol=1e-6, last=None) -> str:
    """'' when the gradients match, else which quantity is off and the fix."""
    if set(got) != set(want):
        return f"{what}: no .grad on {sorted(set(want) - set(got))}: backward every micro-batch"
    shaped = [k for k in want if tuple(got[k].shape) != tuple(want[k].shape)]
    if shaped:  # before any arithmetic: a wrong shape is never broadcast
        return (f"{what}: {shaped[0]}.grad has shape {tuple(got[shaped[0]].shape)}, expected "
                f"{tuple(want[shaped[0]].shape)}: leave the parameters' shapes as they are")
    if all(_close(got[k], want[k], rtol, atol) for k in want):
        return ""
    if last is not None and accum > 1 and all(_close(got[k], last[k], rtol, atol) for k in want):
        return (f"{what}: your gradients are the last micro-batch's alone: zero the gradients once, before the "
                "micro-batch loop (a zero_grad inside it drops what the earlier micro-batches accumulated)")
    ratio = _ratio(got, want)
    for factor, fix in (*([(accum, "divide each micro-batch loss by accum")] if accum > 1 else []),
                        (2.0 ** 12, "step with scaler.step(optimizer), which unscales them first"),
                        (2.0 ** -12, "backward through scaler.scale(loss), so scaler.step's unscaling undoes it")):
        if abs(ratio / factor - 1) < 0.02:
            return f"{what}: your gradients are {ratio:.4g}x the whole batch's: {fix}"
    name = max(want, key=lambda k: max_error(got[k].float(), want[k]))
    err = max_error(got[name].float(), want[name])
    return f"{what}: {name}.grad differs from the whole batch's by up to {err:.2e} (ratio of norms {ratio:.3f})"


def _loss_problem(loss, ref, accum, what, tol) -> str:
    if loss is None:
        return f"{what}: your step returned None: return the mean loss of the batch (a detached tensor)"
    if abs(loss - ref["loss"]) <= tol:
        return ""
    how = f"returned loss {loss:.6f}, the whole batch's mean loss is {ref['loss']:.6f}"
    if abs(loss - accum * ref["loss"]) <= accum * tol:
        return f"{what}: {how} ({accum}x): divide each micro-batch loss by accum"
    return f"{what}: {how}: return the sum of the micro-batch losses, each divided by accum (micro-batch losses " \
           f"{[round(v, 4) for v in ref['micro']]})"


def _forward_problem(out, accum, dtype_name, what) -> str:
    """'' when the model ran `accum` forwards, each in `dtype_name` (its first Linear's output dtype)."""
    seen = out["forward_dtypes"]
    if len(seen) != accum:
        return (f"{what}: your step ran {len(seen)} forwards of the model for accum={accum}: run a forward and a "
                "backward on each of the accum micro-batches (inputs.chunk(accum))")
    if any(d != dtype_name for d in seen):
        return (f"{what}: the first Linear's outputs of the {accum} micro-batches were {seen}, expected "
                f"{[dtype_name] * accum}: run each forward under torch.autocast(x.device.type, dtype=dtype)")
    return ""


def _weights_problem(got: dict, ref, lr, what, atol) -> str:
    start = ref["start"]
    if set(got) != set(start):
        return f"{what}: the model's parameters changed names: {sorted(set(start) ^ set(got))[:3]}: keep the model as given"
    if all(_close(got[k], start[k], 0, 0) for k in start):
        return f"{what}: the weights did not change: step the optimizer, through scaler.step(optimizer)"
    want = {k: start[k] - lr * ref["grads"][k] for k in start}
    if all(_close(got[k], want[k], 1e-4, atol) for k in want):
        return ""
    err = max(max_error(got.get(k), want[k]) for k in want)
    return f"{what}: after the step the weights differ from one SGD step (lr {lr}) on the whole batch by {err:.2e}: " \
           "take exactly one optimizer step, after the last micro-batch"


@case("amp_accum_step", points=2)
def fp32_accum_4_is_one_sgd_step_on_the_whole_batch(student):
    ref = reference(_full_batch, LR, 4)
    out = _step(student, accum=4)
    what = "fp32, accum=4, SGD"
    for problem in (_forward_problem(out, 4, "float32", what),
                    _grad_problem(out["grads"], ref["grads"], what, 4, last=ref["last"]),
                    _loss_problem(out["loss"], ref, 4, what, 1e-5),
                    _weights_problem(out["weights"], ref, LR, what, 1e-6)):
        assert not problem, problem


@case("amp_accum_step", points=1)
def stale_gradients_are_cleared_first(student):
    ref = reference(_full_batch, LR, 2)
    out = _step(student, accum=2, stale=3.0)
    got, want = out["grads"], ref["grads"]
    if set(got) == set(want) and all(_close(got[k] - 3.0, want[k], 1e-4, 1e-5) for k in want):
        raise AssertionError("fp32, accum=2, every .grad holding 3.0 before the call: your gradients include that "
                             "3.0: zero the gradients first (optimizer.zero_grad)")
    problem = _grad_problem(got, want, "fp32, accum=2, stale .grad of 3.0 before the call", 2, last=ref["last"])
    assert not problem, problem


@case("amp_accum_step", points=1)
def fp16_with_a_grad_scaler_unscales_before_the_step(student):
    ref = reference(_full_batch, 0.5, 2)
    out = _step(student, accum=2, dtype_name="float16", init_scale=2.0 ** 12, lr=0.5)
    what = "fp16 autocast, GradScaler(init_scale=4096), accum=2"
    for problem in (_forward_problem(out, 2, "float16", what),
                    _grad_problem(out["grads"], ref["grads"], what, 2, rtol=2e-2, atol=2e-3, last=ref["last"]),
                    _weights_problem(out["weights"], ref, 0.5, what, 2e-3)):
        assert not problem, problem
    assert out["scale"] == 2.0 ** 12, (f"{what}: the scale is {out['scale']:g} after a step without inf: call "
                                       "scaler.update() once per optimizer step")


@case("amp_accum_step", points=1)
def an_overflow_skips_the_step_and_halves_the_scale(student):
    ref = reference(_full_batch, LR, 2)
    out = _step(student, accum=2, dtype_name="float16", init_scale=2.0 ** 16, input_scale=1e6)
    what = "fp16 autocast, inputs x 1e6 (inf in fp16), GradScaler(init_scale=65536)"
    problem = _forward_problem(out, 2, "float16", what)
    assert not problem, problem
    moved = [k for k in ref["start"] if not _close(out["weights"][k], ref["start"][k], 0, 0)]
    assert not moved, (f"{what}: the weights changed ({moved[0]}...): step with scaler.step(optimizer), which skips "
                       "a step whose gradients hold inf or nan")
    assert out["scale"] == 2.0 ** 15, (f"{what}: the scale is {out['scale']:g} after the overflow, expected 32768: "
                                       "call scaler.update() after scaler.step (it halves the scale after an inf)")


@case("amp_accum_step", points=1)
def bf16_autocast_runs_the_forward_in_bf16(student):
    ref = reference(_full_batch, LR, 2)
    out = _step(student, accum=2, dtype_name="bfloat16")
    what = "dtype=torch.bfloat16, accum=2"
    for problem in (_forward_problem(out, 2, "bfloat16", what),
                    _grad_problem(out["grads"], ref["grads"], what, 2, rtol=3e-2, atol=2e-3, last=ref["last"]),
                    _loss_problem(out["loss"], ref, 2, what, 0.02),
                    _weights_problem(out["weights"], ref, LR, what, 2e-3)):
        assert not problem, problem


# ---------------------------------------------------------------- checkpointed_block
def _block():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 32))


def _input(requires_grad):
    import torch

    return torch.randn(16, 32, generator=torch.Generator().manual_seed(2)).requires_grad_(requires_grad)


def _plain(requires_grad):
    """REFERENCE (grader's process): the plain block's output, gradients and bytes saved for backward."""
    from labkit.memory.sqrt_checkpointing import saved_bytes

    block, x = _block(), _input(requires_grad)
    out, kept = saved_bytes(block, x)
    out.square().sum().backward()
    return {"out": out.detach(), "grads": _named(block, "grads"), "x_grad": x.grad, "kept": kept,
            "x_bytes": x.numel() * x.element_size()}


def _checkpoint_harness(checkpointed_block, requires_grad):
    """HARNESS (the student's process): your block call under saved_bytes, then backward when it can."""
    from labkit.memory.sqrt_checkpointing import saved_bytes

    block, x = _block(), _input(requires_grad)
    out, kept = saved_bytes(checkpointed_block, block, x)
    result = {"out": out.detach(), "requires_grad": out.requires_grad, "kept": kept, "grads": {}, "x_grad": None}
    if out.requires_grad:
        out.square().sum().backward()
        result.update(grads=_named(block, "grads"), x_grad=x.grad)
    return result


CHECKPOINTED = {"out": Tensor("float32", (16, 32)), "requires_grad": bool, "kept": int,
                "grads": {str: Tensor("float32")}, "x_grad": ANY}


def _gradients_problem(out, ref, what) -> str:
    import torch

    if not torch.allclose(out["out"], ref["out"], atol=1e-6):
        return f"{what}: your output differs from block(x): return the block's output"
    if not out["requires_grad"]:
        return ""  # the caller names the fix for its case
    problem = _grad_problem(out["grads"], ref["grads"], what, 1, atol=1e-6)
    return problem.replace("the whole batch's", "the plain block's")


@case("checkpointed_block", points=2)
def gradients_equal_the_plain_blocks(student):
    ref = reference(_plain, True)
    out = student.run(_checkpoint_harness, True, returns=CHECKPOINTED)
    what = "x with requires_grad=True"
    assert out["requires_grad"], (f"{what}: your output does not require grad, so backward cannot reach the block: "
                                  "return checkpoint(block, x, use_reentrant=False), not under torch.no_grad()")
    problem = _gradients_problem(out, ref, what)
    assert not problem, problem
    assert out["x_grad"] is not None, (f"{what}: no gradient reached the input x: pass x itself to checkpoint, "
                                       "not x.detach() (the layer below needs dL/dx)")
    x_grad = conform(out["x_grad"], Tensor("float32", (16, 32)), "x.grad after your block's backward")
    err = float((x_grad - ref["x_grad"]).abs().max())
    assert err < 1e-6, f"{what}: x.grad differs from the plain block's by up to {err:.2e}"


@case("checkpointed_block", points=1)
def an_input_without_grad_still_gives_weight_gradients(student):
    ref = reference(_plain, False)
    out = student.run(_checkpoint_harness, False, returns=CHECKPOINTED)
    what = "x with requires_grad=False (e.g. the output of a frozen stem)"
    assert out["requires_grad"], (
        f"{what}: your output does not require grad, so the block's weights get no gradient: use "
        "use_reentrant=False (the reentrant checkpoint only tracks inputs that require grad)")
    problem = _gradients_problem(out, ref, what)
    assert not problem, problem


@case("checkpointed_block", points=1)
def keeps_only_its_input_for_backward(student):
    ref = reference(_plain, True)
    out = student.run(_checkpoint_harness, True, returns=CHECKPOINTED)
    # the memory point is for a checkpoint that works: an output that is block(x) and that backward reaches
    problem = "" if out["requires_grad"] else "your output does not require grad: backward cannot reach the block"
    problem = problem or _gradients_problem(out, ref, "x with requires_grad=True")
    assert not problem, f"{problem} (saving memory counts only for a block that still trains)"
    assert out["kept"] > 0, ("autograd saved 0 B for backward: checkpoint keeps the block's input x for the "
                             "recomputation (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False))")
    assert out["kept"] <= ref["x_bytes"], (
        f"autograd saved {out['kept']:,} B for backward, the plain block {ref['kept']:,} B: wrap the call in "
        f"torch.utils.checkpoint.checkpoint so backward recomputes the block; it keeps only its input "
        f"({ref['x_bytes']:,} B)")
