"""Visible tests of notebook 06's exercises (lora_linear, absmax_quantize_4bit); in-process, no spawn."""
from labkit.course.exercises import case

#: LEGACY: these exercises' tests still run in the student's process; port them to `student.call /
#: run / spawn` (docs/grading.md, "Porting a legacy exercise") and remove their names here.
LEGACY = {"lora_linear", "absmax_quantize_4bit"}


def _with_peft(base, r, alpha):
    """peft's LoRA on the same Linear (a one-layer model: peft targets modules by name)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from torch import nn

    holder = nn.Sequential()
    holder.add_module("fc", copy.deepcopy(base))
    return get_peft_model(holder, LoraConfig(r=r, lora_alpha=alpha, target_modules=["fc"], lora_dropout=0.0))


@case("lora_linear", points=2)
def outputs_and_trainable_count_match_peft(lora_linear):
    import copy

    import torch

    torch.manual_seed(0)
    base, x = torch.nn.Linear(24, 16), torch.randn(5, 24)
    want = base(x).detach()
    mine, theirs = lora_linear(copy.deepcopy(base), r=4, alpha=8.0), _with_peft(base, 4, 8.0)
    torch.testing.assert_close(mine(x), want, msg=lambda m: f"at init (B = 0) LoRA must equal the base Linear: {m}")
    trainable = sum(p.numel() for p in mine.parameters() if p.requires_grad)
    assert trainable == theirs.get_nb_trainable_parameters()[0] == 4 * (24 + 16), (
        f"{trainable} trainable parameters; peft trains {theirs.get_nb_trainable_parameters()[0]} = r (d_in + d_out): "
        "freeze the base weight and bias")
    assert tuple(mine.A.shape) == (4, 24) and tuple(mine.B.shape) == (16, 4), "A is (r, d_in), B is (d_out, r)"
    layer = theirs.base_model.model.fc
    with torch.no_grad():  # the same A, and a B as if training had moved it
        mine.A.copy_(layer.lora_A["default"].weight)
        b = torch.randn(16, 4)
        mine.B.copy_(b)
        layer.lora_B["default"].weight.copy_(b)
    torch.testing.assert_close(mine(x), theirs(x), msg=lambda m: f"with B set, yours differs from peft's: {m}")


def _nf4_roundtrip(w):
    import bitsandbytes.functional as bnbf

    q, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
    return bnbf.dequantize_4bit(q, state)


@case("absmax_quantize_4bit", points=2)
def codes_absmax_and_error(absmax_quantize_4bit):
    import torch

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    codes, absmax = absmax_quantize_4bit(w, block=64)
    assert codes.dtype == torch.int8 and tuple(codes.shape) == (w.numel(),), f"codes: {codes.dtype} {tuple(codes.shape)}"
    assert tuple(absmax.shape) == (w.numel() // 64,), f"absmax shape {tuple(absmax.shape)}: one per block of 64"
    assert int(codes.min()) >= -7 and int(codes.max()) <= 7, f"codes in {int(codes.min())}..{int(codes.max())}"
    blocks = w.reshape(-1, 64)
    torch.testing.assert_close(absmax.float(), blocks.abs().amax(dim=1), msg="absmax must be max |w| of each block")
    back = (codes.float().reshape(-1, 64) / 7 * absmax[:, None])
    err = (back - blocks).abs()
    assert bool((err <= absmax[:, None] / 14 + 1e-6).all()), (
        "some weight is further than half a step (absmax / 14) from its dequantized value: round, don't truncate")
    mine, nf4 = float(err.mean()), float((_nf4_roundtrip(w) - w).abs().mean())
    assert mine < 2 * nf4, f"mean error {mine:.4f} vs bitsandbytes NF4 {nf4:.4f} on the same weights"
