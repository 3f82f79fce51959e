"""Visible tests of notebook 06's exercises (lora_linear, absmax_quantize_4bit); one process, no spawn.

The student's LoRA runs in a harness on the student's side and returns its outputs and gradients; peft's
LoRA on the same Linear, with the same A and B, runs here (`reference`). The quantizer returns its codes
and absmax; the docstring's formula and bitsandbytes' NF4 are computed here.
"""
from labkit.course.exercises import ANY, Either, Tensor, case, reference

# ---------------------------------------------------------------- lora_linear


def _lora_case(seed, d_in, d_out, r, shape, bias=True):
    """The same inputs on both sides: a Linear, an input x of `shape` (..., d_in), a trained-looking A and
    B, and the loss weights c (a loss sum(y * c) whose gradient is c: scale errors show as ratios)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    base = torch.nn.Linear(d_in, d_out, bias=bias)
    x = torch.randn(*shape, d_in, generator=g)
    a, b = torch.randn(r, d_in, generator=g) / d_in ** 0.5, torch.randn(d_out, r, generator=g)
    return base, x, a, b, torch.randn(*shape, d_out, generator=g)


def _lora_fresh(lora_linear, base, r, alpha, x):
    """HARNESS (student's side): the student's LoRALinear as built; its shapes, trainable count, init, output."""
    import torch

    mine = lora_linear(base, r=r, alpha=alpha)
    with torch.no_grad():
        return {"A": list(mine.A.shape), "B": list(mine.B.shape),
                "trainable": sum(p.numel() for p in mine.parameters() if p.requires_grad),
                "A_absmax": float(mine.A.abs().max()), "B_absmax": float(mine.B.abs().max()), "y0": mine(x)}


def _lora_trained(lora_linear, base, r, alpha, x, a, b, c):
    """HARNESS (student's side): A and B set to a and b, one forward and backward of sum(y * c)."""
    import torch

    mine = lora_linear(base, r=r, alpha=alpha)
    with torch.no_grad():
        mine.A.copy_(a)
        mine.B.copy_(b)
    x = x.clone().requires_grad_()
    y = mine(x)
    (y * c).sum().backward()
    return {"y": y.detach(), "A": mine.A.grad, "B": mine.B.grad, "x": x.grad,
            "base": [n for n, p in mine.base.named_parameters() if p.grad is not None]}


def _peft(seed, d_in, d_out, r, alpha, shape, bias):
    """REFERENCE (grader): peft's LoRA on the same Linear with the same A, B; base output, output, grads."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    base, x, a, b, c = _lora_case(seed, d_in, d_out, r, shape, bias)
    holder = torch.nn.Sequential()
    holder.add_module("fc", copy.deepcopy(base))
    model = get_peft_model(holder, LoraConfig(r=r, lora_alpha=alpha, target_modules=["fc"], lora_dropout=0.0))
    layer = model.base_model.model.fc
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(a)
        layer.lora_B["default"].weight.copy_(b)
    x = x.clone().requires_grad_()
    y = model(x)
    (y * c).sum().backward()
    return {"base": base(x).detach(), "y": y.detach(), "A": layer.lora_A["default"].weight.grad,
            "B": layer.lora_B["default"].weight.grad, "x": x.grad,
            "trainable": model.get_nb_trainable_parameters()[0]}


def _ratio(mine, theirs) -> float:
    """How many times `theirs` `mine` is, along `theirs` (a scale error gives exactly that factor)."""
    return float((mine * theirs).sum() / (theirs * theirs).sum())


def _close(mine, theirs, what: str, fix: str) -> None:
    import torch

    if mine is None:
        raise AssertionError(f"{what}: got None (no gradient): {fix}")
    if not isinstance(mine, torch.Tensor) or mine.shape != theirs.shape or mine.dtype != theirs.dtype:
        raise AssertionError(f"{what}: got {mine!r:.80}, expected a float32 tensor of shape {tuple(theirs.shape)}")
    err = float((mine - theirs).abs().max())
    ratio = _ratio(mine, theirs)
    if not torch.allclose(mine, theirs, atol=1e-5, rtol=1e-4):
        raise AssertionError(f"{what} differs from peft's by up to {err:.3g} (yours is {ratio:.2f}x peft's "
                             f"along it): {fix}")


def _check_fresh(student, seed, d_in, d_out, r, alpha, shape, bias=True):
    import torch

    base, x, *_ = _lora_case(seed, d_in, d_out, r, shape, bias)
    got = student.run(_lora_fresh, base, r, alpha, x, returns={
        "A": [int], "B": [int], "trainable": int, "A_absmax": float, "B_absmax": float,
        "y0": Tensor("float32", (*shape, d_out))})
    want = reference(_peft, seed, d_in, d_out, r, alpha, shape, bias)
    assert got["A"] == [r, d_in] and got["B"] == [d_out, r], (
        f"A has shape {tuple(got['A'])}, B {tuple(got['B'])}; A is (r, d_in) = ({r}, {d_in}) and B is (d_out, r) "
        f"= ({d_out}, {r}), so that x A^T B^T maps (..., d_in) to (..., d_out)")
    lora = r * (d_in + d_out)
    if got["trainable"] == lora + d_in * d_out + (d_out if bias else 0):
        raise AssertionError(f"{got['trainable']:,} trainable parameters, expected {lora:,} = r (d_in + d_out), "
                             f"as peft trains {want['trainable']:,}: freeze the base weight and bias "
                             "(base.requires_grad_(False))")
    if bias and got["trainable"] == lora + d_out:
        raise AssertionError(f"{got['trainable']:,} trainable parameters, expected {lora:,} = r (d_in + d_out): the "
                             f"base's bias ({d_out}) still trains; freeze the bias too, not only the weight "
                             "(base.requires_grad_(False) freezes both)")
    assert got["trainable"] == lora, (f"{got['trainable']:,} trainable parameters, expected {lora:,} = r (d_in + "
                                      "d_out): only A and B train; freeze the base weight and bias")
    assert got["B_absmax"] == 0.0, (f"at init max |B| = {got['B_absmax']:.3g}: initialise B to zeros, so that "
                                    "training starts exactly at the base model")
    bound = 1 / d_in ** 0.5
    assert 0 < got["A_absmax"] <= bound + 1e-6, (
        f"at init max |A| = {got['A_absmax']:.3g}, expected in (0, {bound:.3g}]: initialise A with "
        "nn.init.kaiming_uniform_(A, a=math.sqrt(5)) as peft does (random, bounded by 1/sqrt(d_in)); with A and B "
        "both zero no gradient reaches either")
    err = float((got["y0"] - want["base"]).abs().max())
    assert err < 1e-5, (f"at init your output differs from the base Linear's by up to {err:.3g}: with B = 0 the "
                        "update is zero; return base(x) + scaling * x A^T B^T")


def _check_trained(student, seed, d_in, d_out, r, alpha, shape, bias=True):
    base, x, a, b, c = _lora_case(seed, d_in, d_out, r, shape, bias)
    got = student.run(_lora_trained, base, r, alpha, x, a, b, c,  # a gradient may be None: checked below
                      returns={"y": Tensor("float32", (*shape, d_out)), "A": ANY, "B": ANY, "x": ANY, "base": [str]})
    want = reference(_peft, seed, d_in, d_out, r, alpha, shape, bias)
    ratio = _ratio(got["y"] - want["base"], want["y"] - want["base"])
    if abs(ratio - 1) > 1e-3:
        raise AssertionError(f"with A and B set (r={r}, alpha={alpha:g}), your low-rank update x A^T B^T * scaling "
                             f"is {ratio:.2f}x peft's: scale it by alpha / r = {alpha / r:g}")
    _close(got["y"], want["y"], "the output with A and B set", "return base(x) + (alpha / r) x A^T B^T")
    assert not got["base"], (f"the base's {got['base']} got gradients: freeze the base weight and bias "
                             "(base.requires_grad_(False))")
    for name, what in (("A", "A's gradient"), ("B", "B's gradient"), ("x", "the input gradient")):
        _close(got[name], want[name], what, "the update is (alpha / r) x A^T B^T; let autograd differentiate it")


@case("lora_linear", points=2)
def shapes_init_and_frozen_base_match_peft(student):
    _check_fresh(student, 0, 24, 16, 4, 8.0, (5,))


@case("lora_linear", points=2)
def output_and_gradients_match_peft_on_3d_inputs(student):
    _check_trained(student, 1, 12, 20, 2, 32.0, (3, 7))  # (B, T, d_in); scaling 16


# ---------------------------------------------------------------- absmax_quantize_4bit


#: The dtypes absmax may come back in, so that a wrong one gets its own message.
FLOATS = ("float32", "bfloat16", "float16", "float64")


def _weights(seed, shape, scale=1.0):
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _nf4_error(seed, shape, block):
    """REFERENCE (grader): bitsandbytes' NF4 round trip of the same weights, mean |error|."""
    import bitsandbytes.functional as bnbf

    w = _weights(seed, shape)
    q, state = bnbf.quantize_4bit(w, blocksize=block, quant_type="nf4")
    return float((bnbf.dequantize_4bit(q, state) - w).abs().mean())


def _quantized(student, w, block):
    """The student's (codes, absmax) of `w`, their dtypes and shapes checked with messages that say why."""
    import torch

    codes, absmax = student.call(w, block=block, returns=(Tensor("int8"), Either(*map(Tensor, FLOATS))))
    n = w.numel()
    assert absmax.dtype == torch.float32, (f"absmax is {str(absmax.dtype)[6:]} for a {str(w.dtype)[6:]} w: compute "
                                           "it in fp32 (w.float()): one fp32 constant per block, whatever w's dtype")
    assert tuple(codes.shape) == (n,), (f"codes have shape {tuple(codes.shape)}, expected ({n},): one code per "
                                        "element of w.flatten()")
    assert tuple(absmax.shape) == (n // block,), (
        f"absmax has shape {tuple(absmax.shape)} for {n} weights in blocks of {block}, expected ({n // block},): "
        "cut w.flatten() into blocks of `block` elements (reshape(-1, block)), one absmax per block")
    return codes, absmax


def _check_absmax(absmax, blocks):
    import torch

    want = blocks.abs().amax(dim=1)
    if torch.allclose(absmax, blocks.abs().mean(dim=1)):
        raise AssertionError("absmax is the MEAN |w| of each block: use the max |w| of each block, so that every "
                             "weight of the block maps into -7..7")
    if len(absmax) > 1 and bool((absmax == absmax[0]).all()) and not bool((want == want[0]).all()):
        raise AssertionError(f"every block got absmax {float(absmax[0]):.4g}, the max |w| of the whole tensor: "
                             "keep one absmax per block, the max |w| of that block")
    if torch.allclose(absmax, blocks.amax(dim=1)):
        raise AssertionError("absmax is the largest w of each block: take the max of |w| (abs before amax); a "
                             "block's largest magnitude can be negative")
    bad = int((absmax - want).abs().argmax())
    assert torch.allclose(absmax, want), (f"block {bad}: absmax {float(absmax[bad]):.4g}, expected "
                                          f"{float(want[bad]):.4g}: one absmax per block, the max |w| of each block")


def _check_codes(codes, absmax, blocks):
    import torch

    codes = codes.reshape(blocks.shape).float()
    lo, hi = int(codes.min()), int(codes.max())
    assert lo >= -7 and hi <= 7, (f"codes span {lo}..{hi}: 4-bit absmax codes lie in -7..7: scale by 7 "
                                  "(w / absmax * 7), the largest |w| of a block maps to +-7")
    scaled = blocks / absmax.clamp(min=1e-12)[:, None] * 7
    want = torch.round(scaled)
    if not torch.equal(codes, want):
        i = int((codes != want).float().flatten().argmax())
        how = ": round to the nearest code, don't truncate (torch.round)" if torch.equal(codes, scaled.trunc()) \
            else ": code = round(w / absmax * 7)"
        raise AssertionError(f"weight {float(blocks.flatten()[i]):.4f} (w / absmax * 7 = "
                             f"{float(scaled.flatten()[i]):.3f}) got code {int(codes.flatten()[i])}, expected "
                             f"{int(want.flatten()[i])}{how}")


@case("absmax_quantize_4bit", points=2)
def codes_and_absmax_follow_the_formula(student):
    w = _weights(0, (64, 128))
    codes, absmax = _quantized(student, w, 64)
    blocks = w.reshape(-1, 64)
    _check_absmax(absmax, blocks)
    _check_codes(codes, absmax, blocks)
    back = codes.float().reshape(-1, 64) / 7 * absmax[:, None]
    mine, nf4 = float((back - blocks).abs().mean()), reference(_nf4_error, 0, (64, 128), 64)
    assert mine < 2 * nf4, f"mean |error| {mine:.4f}, bitsandbytes' NF4 {nf4:.4f} on the same weights"


@case("absmax_quantize_4bit", points=2)
def blocks_of_32_and_an_all_zero_block(student):
    w = _weights(1, (4, 32), scale=3.0).bfloat16()  # bf16 weights, as a model is loaded: absmax still fp32
    w[1] = 0.0  # a whole block of zeros: codes 0, not NaN
    codes, absmax = _quantized(student, w, 32)
    blocks = w.float().reshape(-1, 32)
    _check_absmax(absmax, blocks)
    assert not bool(absmax.isnan().any()), "absmax holds NaN"
    _check_codes(codes, absmax, blocks)
