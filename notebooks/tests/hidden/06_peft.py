"""Hidden tests of notebook 06's exercises: LoRA gradients and scaling, quantization edge cases."""
from labkit.course.exercises import case

#: LEGACY: these exercises' tests still run in the student's process; port them to `student.call /
#: run / spawn` (docs/grading.md, "Porting a legacy exercise") and remove their names here.
LEGACY = {"lora_linear", "absmax_quantize_4bit"}

MUTANTS = {
    "lora_linear": [
        ("self.scaling = alpha / r", "self.scaling = alpha"),
        ("self.B = nn.Parameter(torch.zeros(base.out_features, r))",
         "self.B = nn.Parameter(torch.randn(base.out_features, r))"),
        ("self.base = base.requires_grad_(False)", "self.base = base"),
    ],
    "absmax_quantize_4bit": [
        ("codes = torch.round(", "codes = torch.trunc("),
        ("blocks.abs().amax(dim=1)", "blocks.abs().mean(dim=1)"),
        ("reshape(-1, block)  # (n_blocks, block)", "reshape(-1, 64)"),
        ("[:, None] * 7)", "[:, None] * 8)"),
    ],
}


@case("lora_linear", points=2)
def gradients_and_scaling_match_peft(lora_linear):
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    base, x = torch.nn.Linear(12, 20), torch.randn(3, 7, 12)
    holder = torch.nn.Sequential()
    holder.add_module("fc", copy.deepcopy(base))
    theirs = get_peft_model(holder, LoraConfig(r=2, lora_alpha=32, target_modules=["fc"], lora_dropout=0.0))
    layer = theirs.base_model.model.fc
    mine = lora_linear(copy.deepcopy(base), r=2, alpha=32)
    with torch.no_grad():
        mine.A.copy_(layer.lora_A["default"].weight)
        b = torch.randn(20, 2)
        mine.B.copy_(b)
        layer.lora_B["default"].weight.copy_(b)
    mine(x).square().mean().backward()
    theirs(x).square().mean().backward()
    assert mine.base.weight.grad is None and mine.base.bias.grad is None, "the base must be frozen"
    torch.testing.assert_close(mine.A.grad, layer.lora_A["default"].weight.grad)
    torch.testing.assert_close(mine.B.grad, layer.lora_B["default"].weight.grad)
    fresh = lora_linear(torch.nn.Linear(12, 20), r=2, alpha=32)
    assert float(fresh.B.detach().abs().max()) == 0.0 and float(fresh.A.detach().abs().max()) > 0, "init: A random, B zero"
    assert float(fresh.A.detach().abs().max()) <= 1 / 12 ** 0.5 + 1e-6, "A: kaiming_uniform_(a=sqrt(5)) bounds |A| by 1/sqrt(d_in)"


@case("absmax_quantize_4bit", points=2)
def zero_blocks_other_block_sizes(absmax_quantize_4bit):
    import torch

    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(1)) * 3
    w[1] = 0.0  # a whole block of zeros
    codes, absmax = absmax_quantize_4bit(w, block=32)
    assert tuple(absmax.shape) == (4,), f"absmax {tuple(absmax.shape)} for 4 blocks of 32"
    assert not torch.isnan(codes.float()).any() and int(codes.reshape(4, 32)[1].abs().max()) == 0
    assert int(codes.min()) >= -7 and int(codes.max()) <= 7
    back = codes.float().reshape(-1, 32) / 7 * absmax[:, None]
    err = (back - w).abs()
    assert bool((err <= absmax[:, None] / 14 + 1e-5).all())
    assert int(codes.abs().max()) == 7, "the largest |w| of a block maps to +-7"
