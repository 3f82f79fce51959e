"""Visible tests of notebook 01_memory's code exercises (`ex.check` in the notebook, `labkit check`, `labkit grade`).

Each test gets a `student`: `student.call(...)` runs the exercise function where the student's code runs
and brings back plain data, checked against `returns=`; everything compared here. Every convention a
test checks is in the exercise's docstring; a failing test says which quantity is off and how to fix it.
"""
from labkit.course.exercises import case

BILLION = 1_000_000_000

#: (precision, optimizer) -> (bytes per parameter, how they add up): the conventions of the docstring.
CONVENTIONS = {
    ("fp32", "adamw"): (16, "4 (weights) + 4 (grads) + 2 x 4 (AdamW's two fp32 states, exp_avg and exp_avg_sq)"),
    ("mixed-bf16", "adamw"): (16, "2 (bf16 weights) + 2 (bf16 grads) + 4 (fp32 master copy) + 2 x 4 (fp32 "
                                  "momentum and variance)"),
    ("bf16", "adamw"): (8, "2 (weights) + 2 (grads) + 2 x 2 (AdamW's two states in bf16; no fp32 master copy)"),
    ("fp16", "adamw"): (8, "2 (weights) + 2 (grads) + 2 x 2 (AdamW's two states in fp16; no fp32 master copy)"),
    ("fp32", "sgd"): (8, "4 (weights) + 4 (grads): plain SGD keeps no optimizer state"),
    ("fp32", "sgd-momentum"): (12, "4 (weights) + 4 (grads) + 4 (one fp32 momentum buffer)"),
    ("mixed-bf16", "sgd"): (8, "2 (bf16 weights) + 2 (bf16 grads) + 4 (the fp32 master copy, kept whatever the "
                               "optimizer)"),
}

#: (precision, optimizer, wrong bytes per parameter) -> the classic mistake that gives it, and its fix.
MISTAKES = {
    ("fp32", "adamw", 12): "AdamW keeps two states per parameter (exp_avg and exp_avg_sq), not one",
    ("mixed-bf16", "adamw", 8): "count the fp32 master copy (4 B): mixed precision keeps one beside the bf16 "
                                "weights, and AdamW's states in fp32 too",
    ("mixed-bf16", "adamw", 12): "in mixed precision AdamW's states are fp32 (4 B each), not the weights' 2 B",
    ("bf16", "adamw", 12): "pure bf16 keeps the optimizer states in bf16 too (2 B each), not in fp32",
    ("bf16", "adamw", 16): "pure bf16 keeps no fp32 master copy, and its states in bf16 (2 B each)",
    ("fp16", "adamw", 12): "pure fp16 keeps the optimizer states in fp16 too (2 B each), not in fp32",
    ("fp32", "sgd", 12): "plain SGD keeps no optimizer state: only SGD with momentum has a buffer",
    ("fp32", "sgd-momentum", 8): "SGD with momentum keeps one buffer per parameter (4 B in fp32)",
    ("fp32", "sgd-momentum", 16): "SGD with momentum keeps one buffer per parameter, not two",
    ("mixed-bf16", "sgd", 4): "count the fp32 master copy (4 B): mixed precision keeps it whatever the optimizer",
}


def _per_param(student, precision, optimizer, zero=0, dp=1):
    """The student's bytes per parameter for a 1B-parameter model."""
    return student.call(BILLION, precision, optimizer, zero, dp, returns=int) / BILLION


def _check_conventions(student, pairs):
    for precision, optimizer in pairs:
        want, how = CONVENTIONS[precision, optimizer]
        got = _per_param(student, precision, optimizer)
        fix = MISTAKES.get((precision, optimizer, got))
        assert got == want, (f"{precision} {optimizer}, no ZeRO: got {got:g} B per parameter, expected {want} = "
                             f"{how}" + (f": {fix}" if fix else ""))


@case("model_state_bytes", points=1)
def adamw_in_fp32_is_what_torch_allocates(student):
    _check_conventions(student, [("fp32", "adamw")])


@case("model_state_bytes", points=2)
def mixed_bf16_adamw_is_the_zero_papers_16_bytes(student):
    got = _per_param(student, "mixed-bf16", "adamw")
    if got == 12 and _per_param(student, "fp32", "adamw") != 16:  # 4 B short: one AdamW state missing
        raise AssertionError("mixed-bf16 adamw: got 12 B per parameter, expected 16: AdamW keeps two states per "
                             "parameter (exp_avg and exp_avg_sq), not one")
    _check_conventions(student, [("mixed-bf16", "adamw")])


@case("model_state_bytes", points=1)
def pure_bf16_and_fp16_keep_everything_in_two_bytes(student):
    _check_conventions(student, [("bf16", "adamw"), ("fp16", "adamw")])


@case("model_state_bytes", points=1)
def sgd_keeps_no_state_and_momentum_one(student):
    _check_conventions(student, [("fp32", "sgd"), ("fp32", "sgd-momentum"), ("mixed-bf16", "sgd")])


#: ZeRO stage -> (bytes per parameter of mixed-bf16 AdamW over 4 ranks, what the stage divides).
ZERO_OVER_4 = {1: (7.0, "ZeRO-1 divides the optimizer states (fp32 master copy included) by dp: 2 + 2 + 12/4"),
               2: (5.5, "ZeRO-2 also divides the gradients: 2 + 2/4 + 12/4"),
               3: (4.0, "ZeRO-3 also divides the weights: (2 + 2 + 12)/4")}


@case("model_state_bytes", points=2)
def zero_stages_shard_states_then_grads_then_weights(student):
    for stage, (want, how) in ZERO_OVER_4.items():
        got = _per_param(student, "mixed-bf16", "adamw", stage, 4)
        assert got == want, (f"mixed-bf16 adamw, ZeRO-{stage} over dp=4: got {got:g} B per parameter, expected "
                             f"{want:g}: {how}")


@case("model_state_bytes", points=1)
def shards_round_up_to_whole_bytes(student):
    got = student.call(10, "fp32", "sgd", 3, 3, returns=int)
    assert got == 28, (f"10 fp32 parameters, plain SGD, ZeRO-3 over 3 ranks: got {got} B, expected 28 = 14 (weights) "
                       "+ 14 (grads): round each divided part up (math.ceil(40 / 3) = 14), since a shard holds "
                       "whole bytes")


# ---------------------------------------------------------------- measure_state_bytes
STATES = {"weights": int, "grads": int, "optimizer": int}


def _mlp(*dims, dtype=None):
    import torch

    torch.manual_seed(0)
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    return model.to(dtype) if dtype is not None else model


def _assert_part(got, part, want, why):
    assert got[part] == want, f"{part}: got {got[part]:,} B, expected {want:,} B ({why})"


@case("measure_state_bytes", points=2)
def adamw_fp32_counts_what_torch_keeps(student):
    import torch

    model = _mlp(16, 32, 8)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    got = student.call(model, torch.optim.AdamW(params), torch.randn(4, 16), returns=STATES)
    _assert_part(got, "weights", 4 * n, f"4 B x {n:,} fp32 parameters")
    assert got["grads"] != 0, "grads: got 0 B: call loss.backward() before counting; .grad is None until then"
    _assert_part(got, "grads", 4 * n, f"one fp32 .grad per parameter: 4 B x {n:,}")
    want = 8 * n + 4 * len(params)
    assert got["optimizer"] != 0, ("optimizer: got 0 B: call optimizer.step(); AdamW creates exp_avg and exp_avg_sq "
                                   "on its first step")
    assert got["optimizer"] != 4 * len(params), (
        f"optimizer: got {got['optimizer']:,} B, only the 4 B `step` of each of the {len(params)} parameter tensors: "
        "count every tensor in optimizer.state (exp_avg and exp_avg_sq too)")
    _assert_part(got, "optimizer", want, f"exp_avg + exp_avg_sq: 2 x 4 B x {n:,}, plus a 4 B `step` per parameter "
                                         f"tensor x {len(params)}")


@case("measure_state_bytes", points=1)
def sgd_momentum_in_bf16_counts_two_bytes_an_element(student):
    import torch

    model = _mlp(32, 16, dtype=torch.bfloat16)
    model[0].bias.requires_grad_(False)  # a frozen parameter: no .grad, no momentum_buffer
    n = sum(p.numel() for p in model.parameters())
    k = n - model[0].bias.numel()  # the trainable elements
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    got = student.call(model, opt, torch.randn(5, 32, dtype=torch.bfloat16), returns=STATES)
    if got["weights"] == 4 * n:
        raise AssertionError(f"weights: got {4 * n:,} B for {n:,} bf16 parameters, expected {2 * n:,}: a tensor holds "
                             "numel() x element_size() bytes, and element_size() is 2 for bf16")
    _assert_part(got, "weights", 2 * n, f"2 B x {n:,} bf16 parameters")
    if got["grads"] == 2 * n:
        raise AssertionError(f"grads: got {2 * n:,} B, expected {2 * k:,}: the bias is frozen (requires_grad False); "
                             "a frozen parameter has no .grad: count p.grad only where it is not None")
    _assert_part(got, "grads", 2 * k, "bf16 grads, 2 B each, none for the frozen bias")
    _assert_part(got, "optimizer", 2 * k, "SGD's momentum_buffer, in the parameters' bf16, none for the frozen bias")
