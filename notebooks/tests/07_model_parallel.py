"""Visible tests of notebook 07's exercises (tensor and pipeline parallelism by hand).

The student's code runs on 3 gloo ranks (2 ranks hide mistakes that 3 show) in a harness that returns what
it produced: outputs, the gradients of the weights AND of the input, the loss. The single-device model on
the same seeded weights and data runs here (`reference`): Megatron's TP and GPipe only reorganise its work,
so every rank must match it. A loss sum(y * c) has gradient c, so scale errors show as exact ratios.
"""
from labkit.course.exercises import ANY, StudentError, Tensor, case, pairs, reference

WORLD = 3


def _linear_case(seed, d_in, d_out, shape, bias=True):
    """The same Linear, input x (*shape, d_in) and loss weights c (*shape, d_out) on every rank and here."""
    import torch

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    full = torch.nn.Linear(d_in, d_out, bias=bias)
    return full, torch.randn(*shape, d_in, generator=g), torch.randn(*shape, d_out, generator=g)


def _single(seed, d_in, d_out, shape, bias=True):
    """REFERENCE (grader): the single-device Linear's output and the gradients of sum(y * c)."""
    full, x, c = _linear_case(seed, d_in, d_out, shape, bias)
    x.requires_grad_()
    y = full(x)
    (y * c).sum().backward()
    return {"y": y.detach(), "x": x.grad, "w": full.weight.grad, "b": full.bias.grad if bias else None,
            "bias": full.bias.detach() if bias else None}


def _grad(t):
    return None if t is None else t.detach().clone()


def _column_yours(rank, world, column_parallel, seed, d_in, d_out, shape, bias=True):
    """HARNESS (student's ranks): this rank's rows of W and b, the gathered output, its gradients, and the
    un-gathered output of gather_output=False."""
    full, x, c = _linear_case(seed, d_in, d_out, shape, bias)
    rows = slice(rank * d_out // world, (rank + 1) * d_out // world)
    w = full.weight.detach()[rows].clone().requires_grad_()
    b = full.bias.detach()[rows].clone().requires_grad_() if bias else None
    xx = x.clone().requires_grad_()
    y = column_parallel(xx, w, b)
    local = column_parallel(x, w.detach(), None if b is None else b.detach(), gather_output=False)
    if y.shape != c.shape:  # no backward of a wrong shape: the test names the shape
        return {"y": y.detach(), "local": local.detach(), "x": None, "w": None, "b": None}
    (y * c).sum().backward()
    return {"y": y.detach(), "local": local.detach(), "x": _grad(xx.grad), "w": _grad(w.grad),
            "b": _grad(b.grad) if bias else None}


def _row_yours(rank, world, row_parallel, seed, d_in, d_out, shape, bias=True):
    """HARNESS (student's ranks): this rank's input features and columns of W, the full bias; the output
    and its gradients."""
    full, x, c = _linear_case(seed, d_in, d_out, shape, bias)
    cols = slice(rank * d_in // world, (rank + 1) * d_in // world)
    xs = x[..., cols].clone().requires_grad_()
    w = full.weight.detach()[:, cols].clone().requires_grad_()
    b = full.bias.detach().clone().requires_grad_() if bias else None
    y = row_parallel(xs, w, b)
    (y * c).sum().backward()
    return {"y": y.detach(), "x": _grad(xs.grad), "w": _grad(w.grad), "b": _grad(b.grad) if bias else None}


def _ratio(mine, want) -> float:
    """How many times `want` `mine` is, along `want` (a scale error gives exactly that factor)."""
    den = float((want * want).sum())
    return float((mine * want).sum()) / den if den else float("nan")


def _same(mine, want, tol=1e-5) -> bool:
    import torch

    return (isinstance(mine, torch.Tensor) and mine.shape == want.shape and mine.dtype == want.dtype
            and torch.allclose(mine, want, atol=tol, rtol=1e-4))


def _grad_problem(mine, want, what: str):
    """None when `mine` is `want`, else the start of a message naming what is off."""
    import torch

    if mine is None:
        return f"{what} is None: it did not reach the autograd graph (no .detach() / no torch.no_grad())"
    if not isinstance(mine, torch.Tensor) or mine.shape != want.shape:
        return f"{what} has shape {tuple(getattr(mine, 'shape', ()))}, expected {tuple(want.shape)}"
    if _same(mine, want):
        return None
    return (f"{what} differs from the single-device one by up to {float((mine - want).abs().max()):.3g} "
            f"({_ratio(mine, want):.2f}x it)")


def _explained(run, hints: dict):
    """run(), with the hint of a known symptom added to the student's error."""
    try:
        return run()
    except StudentError as exc:
        hint = next((fix for symptom, fix in hints.items() if symptom in str(exc)), None)
        if hint is None:
            raise
        raise AssertionError(f"{str(exc)[:300]}: {hint}") from None


#: Errors a rank raises on a classic mistake of the tensor-parallel exercises -> the fix.
TP_ERRORS = {"Backward returned an invalid gradient at index 0":
             "a backward returns one gradient per input of forward, of that input's shape: GatherFromTP's "
             "backward keeps this rank's slice, grad.chunk(world, dim=-1)[rank]"}


# ---------------------------------------------------------------- column_parallel
COLUMN = (0, 5, 6, (2, 3))  # seed, d_in, d_out = 2 per rank, input (B, T, d_in)


@case("column_parallel", points=3)
def column_parallel_matches_one_device_with_input_gradients_on_3_ranks(student):
    spec = {"y": Tensor("float32"), "local": Tensor("float32"), "x": ANY, "w": ANY, "b": ANY}
    got = _explained(lambda: student.spawn(_column_yours, world=WORLD, args=COLUMN, returns=spec), TP_ERRORS)
    check_column(got, reference(_single, *COLUMN), COLUMN[2])


def check_column(got, want, d_out, world=WORLD):
    """Per rank: the gathered output, the local slice, the weight and bias gradients, then the input
    gradient -- each with the fix its symptom points to."""
    import torch

    n = d_out // world
    for rank, mine in enumerate(got):
        where = f"rank {rank} of {world}"
        y, rows = mine["y"], slice(rank * n, (rank + 1) * n)
        assert tuple(y.shape) == tuple(want["y"].shape), (
            f"{where}: the gathered output has shape {tuple(y.shape)}, expected {tuple(want['y'].shape)}: "
            "concatenate the ranks' shards along the last dim (torch.cat(parts, dim=-1))")
        assert _same(y, want["y"]), (f"{where}: the gathered output differs from the single-device Linear's by up "
                                     f"to {float((y - want['y']).abs().max()):.3g}: each rank computes x @ "
                                     "w_shard.T + b_shard, then all-gathers the shards in rank order")
        local = mine["local"]
        assert tuple(local.shape) == (*want["y"].shape[:-1], n) and _same(local, want["y"][..., rows]), (
            f"{where}: gather_output=False returned shape {tuple(local.shape)}, expected this rank's slice "
            f"{(*want['y'].shape[:-1], n)} (output features {rows.start}..{rows.stop - 1}), not gathered")
        for key, name in (("w", "w_shard.grad"), ("b", "b_shard.grad")):
            if want[key] is None:
                continue
            problem = _grad_problem(mine[key], want[key][rows], f"{where}: {name}")
            if problem is None:
                continue
            other = [r for r in range(world) if r != rank and _same(mine[key], want[key][r * n:(r + 1) * n])]
            if other:
                raise AssertionError(f"{where}: {name} is the gradient of rank {other[0]}'s rows: in GatherFromTP's "
                                     "backward keep THIS rank's slice of the output gradient, "
                                     "grad.chunk(world, dim=-1)[rank]")
            raise AssertionError(f"{problem}: the gather's backward gives each rank its slice of the output gradient")
    xs = [mine["x"] for mine in got]
    for rank, mine in enumerate(xs):
        problem = _grad_problem(mine, want["x"], f"rank {rank} of {world}: x.grad (the input gradient)")
        if problem is None:
            continue
        if _same(mine, want["x"] / world):
            raise AssertionError(f"{problem}: the all-reduce must sum the ranks' parts, don't average them "
                                 "(no division by the world size)")
        if all(isinstance(t, torch.Tensor) and t.shape == want["x"].shape for t in xs) and _same(sum(xs), want["x"]):
            raise AssertionError(f"{problem}; it is only this rank's part: the ranks' x.grad add up to the single-"
                                 "device one. In f's backward (CopyToTP.backward) all-reduce (sum) the input gradient "
                                 "over the group: every rank's output shard depends on the whole input")
        raise AssertionError(f"{problem}: f's backward all-reduces (sums) the input gradient over the group")


# ---------------------------------------------------------------- row_parallel
ROW = (1, 9, 4, (2, 3))  # seed, d_in = 3 per rank, d_out, input (B, T, d_in)


@case("row_parallel", points=3)
def row_parallel_matches_one_device_with_input_gradients_on_3_ranks(student):
    spec = {"y": Tensor("float32"), "x": ANY, "w": ANY, "b": ANY}
    got = _explained(lambda: student.spawn(_row_yours, world=WORLD, args=ROW, returns=spec), TP_ERRORS)
    check_row(got, reference(_single, *ROW), ROW[1])


def check_row(got, want, d_in, world=WORLD):
    """Per rank: the output (bias once, partial products summed), then the gradients of x_shard, w_shard, bias."""
    n = d_in // world
    ys = [mine["y"] for mine in got]
    for rank, mine in enumerate(got):
        where, y = f"rank {rank} of {world}", mine["y"]
        assert tuple(y.shape) == tuple(want["y"].shape), (
            f"{where}: the output has shape {tuple(y.shape)}, expected {tuple(want['y'].shape)}: every rank "
            "returns the full (..., out)")
        if _same(y, want["y"]):
            continue
        extra = y - want["y"]
        bias = 0 if want["bias"] is None else want["bias"].expand_as(extra)
        times = 0 if want["bias"] is None else _ratio(extra, bias)
        if round(times) != 0 and _same(extra, round(times) * bias):
            raise AssertionError(f"{where}: your output is the single-device one plus {times:.2f} x the bias: add "
                                 "the bias once, after the all-reduce (not in every rank's partial product)")
        if all(t.shape == want["y"].shape for t in ys) and _same(sum(ys) - (world - 1) * bias, want["y"]):
            raise AssertionError(f"{where}: the output holds only this rank's partial product: in g's forward "
                                 "(ReduceFromTP.forward) all-reduce (sum) the partial products over the group")
        raise AssertionError(f"{where}: the output differs from the single-device Linear's by up to "
                             f"{float(extra.abs().max()):.3g} ({_ratio(y, want['y']):.2f}x it): all-reduce (sum) the "
                             "partial products x_shard @ w_shard.T, then add the bias once")
    for rank, mine in enumerate(got):
        cols = slice(rank * n, (rank + 1) * n)
        for key, name, ref in (("x", "x_shard.grad (the input gradient)", want["x"][..., cols]),
                               ("w", "w_shard.grad", want["w"][:, cols]), ("b", "bias.grad", want["b"])):
            if ref is None:
                continue
            problem = _grad_problem(mine[key], ref, f"rank {rank} of {world}: {name}")
            if problem is None:
                continue
            if abs(_ratio(mine[key], ref) - world) < 1e-3:
                raise AssertionError(f"{problem}: g's backward is the identity: every rank's partial product "
                                     "receives the same full gradient, so don't all-reduce it in backward")
            raise AssertionError(f"{problem}: g's backward passes the output gradient through unchanged")


# ---------------------------------------------------------------- gpipe_step
GPIPE = (2, 4, 8)  # seed, micro-batches, batch


def _gpipe_model(seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3))


def _gpipe_data(seed, batch):
    import torch

    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(batch, 4, generator=g), torch.randn(batch, 3, generator=g)


def _gpipe_single(seed, microbatches, batch):
    """REFERENCE (grader): the whole model on one device, the whole batch: loss and every parameter's gradient."""
    import torch

    model = _gpipe_model(seed)
    x, t = _gpipe_data(seed, batch)
    loss = torch.nn.functional.mse_loss(model(x), t)
    loss.backward()
    return {"loss": float(loss.detach()), "grads": [p.grad for p in model.parameters()]}


def _gpipe_last_alone(seed, microbatches, batch):
    """REFERENCE (grader): the gradients of the last micro-batch's loss / m alone (a zero_grad inside the loop)."""
    import torch

    model = _gpipe_model(seed)
    x, t = (d.chunk(microbatches)[-1] for d in _gpipe_data(seed, batch))
    (torch.nn.functional.mse_loss(model(x), t) / microbatches).backward()
    return [p.grad for p in model.parameters()]


def _gpipe_yours(rank, world, gpipe_step, seed, microbatches, batch):
    """HARNESS (student's ranks): stage `rank` = layers 2 rank .. 2 rank + 1 of the model; the loss it
    returned, its parameters' gradients, and the order in which its forwards and backwards ran."""
    import torch

    model = _gpipe_model(seed)
    x, t = _gpipe_data(seed, batch)
    events = []

    class Recorded(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, a):
            events.append(["F", a.shape[0]])
            out = self.inner(a)
            if out.requires_grad:
                out.register_hook(lambda g: events.append(["B", g.shape[0]]))
            return out

    stage = Recorded(model[2 * rank:2 * rank + 2])
    loss = gpipe_step(stage, x if rank == 0 else None, t if rank == world - 1 else None,
                      torch.nn.functional.mse_loss, microbatches, (batch // microbatches, 8))
    return {"loss": loss, "grads": [_grad(p.grad) for p in stage.parameters()], "events": events}


#: Symptoms of a rank's error (what the student's rank raised) -> the fix.
GPIPE_ERRORS = {"'NoneType' object has no attribute 'contiguous'":
                "x.grad is None on a stage that received x: call x.requires_grad_() on the received activation, "
                "so that backward gives it a gradient to send back to rank r - 1"}


@case("gpipe_step", points=3)
def gpipe_loss_and_grads_equal_one_device_on_3_stages(student):
    spec = {"loss": float | None, "grads": [ANY], "events": [[ANY]]}
    got = _explained(lambda: student.spawn(_gpipe_yours, world=WORLD, args=GPIPE, returns=spec), GPIPE_ERRORS)
    check_gpipe(got, reference(_gpipe_single, *GPIPE), *GPIPE[1:], alone=reference(_gpipe_last_alone, *GPIPE))


def check_gpipe(got, want, m, batch, world=WORLD, alone=None):
    """The loss (last stage only, the sum of the micro-batches' loss / m), every stage's gradients, the order;
    `alone`: the gradients of the last micro-batch alone, to name a zero_grad inside the micro-batch loop."""
    last = got[-1]["loss"]
    for rank, mine in enumerate(got[:-1]):
        assert mine["loss"] is None, (f"stage {rank} of {world} returned {mine['loss']!r}: only the last stage "
                                      "returns the loss; the others return None")
    assert last is not None, "the last stage returned None: it returns the batch's loss (a float)"
    ratio = last / want["loss"]
    assert abs(ratio - m) > 1e-4, (f"the last stage's loss {last:.5f} is {m}x the single-device loss "
                                   f"{want['loss']:.5f}: divide each micro-batch's loss by microbatches ({m})")
    assert abs(last - want["loss"]) < 1e-5, (
        f"the last stage's loss {last:.5f} != the single-device loss {want['loss']:.5f} ({ratio:.2f}x): return the "
        "sum over the micro-batches of loss_fn(output_i, targets_i) / microbatches")
    for rank, mine in enumerate(got):
        refs = want["grads"][2 * rank:2 * rank + 2]
        assert len(mine["grads"]) == len(refs), (
            f"stage {rank} of {world} has {len(mine['grads'])} parameters after your step, expected {len(refs)} "
            "(its layers' weights and biases): leave the stage's parameters in place; run every micro-batch's "
            "forward and backward through it")
        for i, (g, ref) in enumerate(pairs(mine["grads"], refs, f"stage {rank} of {world}'s gradients")):
            problem = _grad_problem(g, ref, f"stage {rank} of {world}: parameter {i}'s gradient")
            if problem is None:
                continue
            if g is not None and float(g.abs().max()) == 0 and rank < world - 1:
                raise AssertionError(f"{problem}, all zeros: every stage r > 0 sends x.grad of each micro-batch "
                                     "back to rank r - 1, which backpropagates it with y.backward(grad)")
            if g is not None and alone is not None and _grad_problem(g, alone[2 * rank + i], "") is None:
                raise AssertionError(f"{problem}: it is the last micro-batch's alone: gradients accumulate over the "
                                     "micro-batches in the stage's parameters; don't zero them (zero_grad) per "
                                     "micro-batch")
            if g is not None and abs(_ratio(g, ref) - m) < 1e-3:
                raise AssertionError(f"{problem}: divide each micro-batch's loss by microbatches ({m})")
            raise AssertionError(f"{problem}: run every micro-batch's forward and backward through the stage; "
                                 "gradients accumulate in its parameters")
    size = batch // m
    for rank, mine in enumerate(got):
        assert mine["events"] == [["F", size]] * m + [["B", size]] * m, (
            f"stage {rank} of {world} ran {' '.join(f'{k}{n}' for k, n in mine['events'][:12])} (F or B, then the "
            f"micro-batch's size); GPipe runs all {m} forwards first, then all {m} backwards, on micro-batches of "
            f"{size}")


# ---------------------------------------------------------------- bubble_fraction
#: (wrong value for (p, m)) -> the mistake: each a function of p, m the classic mistake computes.
BUBBLE_MISTAKES = (
    (lambda p, m: (p - 1) / m, "divide the idle slots by the slots of the whole step, not by the busy ones"),
    (lambda p, m: p / (m + p), "a wave of m micro-batches through p stages takes m + p - 1 slots, not m + p"),
    (lambda p, m: (2 * (m + p - 1) - m) / (2 * (m + p - 1)),
     "a stage computes 2m slots of the step: m forwards and m backwards"),
)


def _bubble_reference(p, m):
    from labkit.parallel.comm import bubble_fraction

    return bubble_fraction(p, m)


@case("bubble_fraction", points=2)
def bubble_fraction_counts_the_grid(student):
    grid = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 4, 7, 16)]
    got = {pm: student.call(*pm, returns=float) for pm in grid}
    bad = [pm for pm in grid if abs(got[pm] - reference(_bubble_reference, *pm)) >= 1e-9]
    if not bad:
        return
    # one mistake can agree with another at a point ((1, 1)): name the one that gives every answer of the grid
    fix = next((why for wrong, why in BUBBLE_MISTAKES if all(abs(got[pm] - wrong(*pm)) < 1e-9 for pm in grid)),
               "count the step's slots (first forward to last backward of stage 0) and the 2m one stage "
               "computes; return idle / total")
    p, m = next((pm for pm in bad if pm[0] > 1), bad[0])
    raise AssertionError(f"bubble_fraction({p}, {m}) = {got[p, m]:.4f}, expected "
                         f"{reference(_bubble_reference, p, m):.4f}: {fix}")


@case("bubble_fraction", points=1)
def no_stages_or_micro_batches_raise(student):
    for bad in ((0, 4), (2, 0)):
        with student.raises(ValueError):
            student.call(*bad, returns=float)
