"""Hidden tests of notebook 06's exercises (run by `labkit grade`; students see only pass/fail per test and
VARIES). They reuse the visible file's harnesses and checks with other inputs; references are computed here
(peft's LoRA, the docstring's formula), never where the student's code runs."""
from labkit.course.exercises import case
from labkit.course.exercises.cases import visible_twin

visible = visible_twin(__labkit_test_file__)  # noqa: F821 - set by the test loader

#: What the hidden tests vary, per exercise: `ex.check` and `labkit check` show this line, nothing else.
VARIES = {
    "lora_linear": "a Linear without bias, rank 1, other alphas and input shapes",
    "absmax_quantize_4bit": "other block sizes and shapes, tiny and large weights, blocks whose largest |w| is "
                            "negative",
}

#: Classic mistakes. (fragment, replacement, fix): a VISIBLE test must fail with `fix` in its message;
#: (fragment, replacement): any test may catch it (tests/test_exercises_ci.py checks both).
MUTANTS = {
    "lora_linear": [
        ("self.scaling = alpha / r", "self.scaling = alpha", "scale it by alpha / r"),
        ("(x @ self.A.T @ self.B.T) * self.scaling", "(x @ self.A.T @ self.B.T)", "scale it by alpha / r"),
        ("self.B = nn.Parameter(torch.zeros(base.out_features, r))",
         "self.B = nn.Parameter(torch.randn(base.out_features, r))", "initialise B to zeros"),
        ("self.base = base.requires_grad_(False)", "self.base = base", "freeze the base weight and bias"),
        ("self.base = base.requires_grad_(False)", "self.base = base\n        base.weight.requires_grad_(False)",
         "freeze the bias too"),
        ("nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))", "nn.init.zeros_(self.A)",
         "initialise A with nn.init.kaiming_uniform_"),
        ("self.A = nn.Parameter(torch.empty(r, base.in_features))",
         "self.A = nn.Parameter(torch.empty(base.in_features, r))"),
    ],
    "absmax_quantize_4bit": [
        ("codes = torch.round(", "codes = torch.trunc(", "round to the nearest code, don't truncate"),
        ("blocks.abs().amax(dim=1)", "blocks.abs().mean(dim=1)", "the max |w| of each block"),
        ("blocks.abs().amax(dim=1)", "blocks.abs().amax().repeat(blocks.shape[0])", "one absmax per block"),
        ("reshape(-1, block)  # (n_blocks, block)", "reshape(-1, 64)", "reshape(-1, block)"),
        ("[:, None] * 7)", "[:, None] * 8)", "scale by 7"),
        ("blocks.abs().amax(dim=1)", "blocks.amax(dim=1)", "take the max of |w|"),
        ("w.detach().float()", "w.detach()", "compute it in fp32"),
    ],
}


@case("lora_linear", points=1)
def no_bias_rank_1(student):
    visible._check_fresh(student, 5, 10, 6, 1, 1.0, (4,), bias=False)
    visible._check_trained(student, 6, 10, 6, 1, 1.0, (2, 3, 4), bias=False)


@case("lora_linear", points=1)
def rank_8_alpha_16_on_longer_sequences(student):
    visible._check_trained(student, 7, 32, 8, 8, 16.0, (2, 11))


@case("absmax_quantize_4bit", points=1)
def blocks_of_16_on_an_odd_shape(student):
    w = visible._weights(2, (3, 48))
    codes, absmax = visible._quantized(student, w, 16)
    visible._check_absmax(absmax, w.reshape(-1, 16))
    visible._check_codes(codes, absmax, w.reshape(-1, 16))


@case("absmax_quantize_4bit", points=1)
def tiny_large_and_negative_extremes(student):
    for seed, scale in ((3, 1e-3), (4, 100.0)):
        w = visible._weights(seed, (8, 64), scale)
        w[0, 5] = -4 * scale  # the largest |w| of block 0 is negative: it maps to -7
        codes, absmax = visible._quantized(student, w, 64)
        visible._check_absmax(absmax, w.reshape(-1, 64))
        visible._check_codes(codes, absmax, w.reshape(-1, 64))
        assert int(codes[5]) == -7
