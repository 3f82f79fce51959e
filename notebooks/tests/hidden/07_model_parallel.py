"""Hidden tests of notebook 07's exercises (run by `labkit grade`; students see only pass/fail per test and
VARIES). They reuse the visible file's harnesses and checks with other inputs; the references (the
single-device model, labkit's bubble formula and schedule replay) are computed here, never where the
student's code runs."""
from labkit.course.exercises import ANY, Either, Tensor, case, pairs, reference
from labkit.course.exercises.cases import visible_twin

visible = visible_twin(__labkit_test_file__)  # noqa: F821 - set by the test loader

#: What the hidden tests vary, per exercise: `ex.check` and `labkit check` show this line, nothing else.
VARIES = {
    "column_parallel": "2 ranks, no bias, 2-D inputs and other widths, a sub-group of the ranks",
    "row_parallel": "2 ranks, no bias, other widths, a sub-group of the ranks",
    "gpipe_step": "2 stages, other micro-batch counts, a classification loss, a sub-group of the ranks",
    "bubble_fraction": "larger pipelines and micro-batch counts, and a schedule replayed slot by slot",
}

#: Classic mistakes. (fragment, replacement, fix): a VISIBLE test must fail with `fix` in its message;
#: (fragment, replacement): any test may catch it (tests/test_exercises_ci.py checks both). Each mutant of a
#: multi-rank exercise costs CI one spawn per test (5 rank processes): the most common mistakes only.
MUTANTS = {
    "column_parallel": [
        # the stub's own trailing `return grad, None` with nothing above it: f's backward is the identity
        ("dist.all_reduce(grad, group=ctx.group)", "pass", "all-reduce (sum) the input gradient"),
        ("dist.all_reduce(grad, group=ctx.group)",
         "dist.all_reduce(grad, group=ctx.group)\n        grad /= dist.get_world_size(ctx.group)", "don't average"),
        ("return grad.chunk(world, dim=-1)[rank].contiguous(), None",
         "return grad.chunk(world, dim=-1)[0].contiguous(), None", "grad.chunk(world, dim=-1)[rank]"),
        ("torch.cat(parts, dim=-1)", "torch.cat(parts, dim=0)", "along the last dim"),
        # `group` ignored by the gather (issue #39: a test on the sub-group [1, 2] of 3 ranks)
        ("dist.all_gather(parts, y_local.contiguous(), group=group)", "dist.all_gather(parts, y_local.contiguous())"),
    ],
    "row_parallel": [
        ("torch.nn.functional.linear(x_shard, w_shard), group)  # sum of partials\n"
         "    return y + bias if bias is not None else y",
         "torch.nn.functional.linear(x_shard, w_shard, bias), group)\n    return y", "add the bias once"),
        ("        return grad, None", "        grad = grad.clone()\n        dist.all_reduce(grad)\n        return grad, None",
         "g's backward is the identity"),
        ("        dist.all_reduce(y, group=group)", "        pass", "all-reduce (sum) the partial products"),
    ],
    "gpipe_step": [
        ("y = loss_fn(y, ts[i]) / microbatches", "y = loss_fn(y, ts[i])", "divide each micro-batch's loss"),
        ("dist.send(x.grad.contiguous(), dst=peer(rank - 1), group=group)",
         "dist.send(torch.zeros_like(x.grad), dst=peer(rank - 1), group=group)", "sends x.grad of each micro-batch"),
        ("            x.requires_grad_()", "            pass", "x.requires_grad_()"),
        ("return total if last else None", "return total", "only the last stage returns the loss"),
        ("    for x, y in saved:\n", "    for x, y in saved:\n        stage.zero_grad()\n",
         "the last micro-batch's alone"),
        # `group` ignored: rank r of the group is taken for global rank r (issue #39: a test on ranks [1, 2])
        ("peer = lambda r: dist.get_global_rank(group, r) if group is not None else r", "peer = lambda r: r"),
    ],
    "bubble_fraction": [
        ("total = 2 * (microbatches + stages - 1)", "total = 2 * (microbatches + stages)", "m + p - 1 slots"),
        ("busy = 2 * microbatches", "busy = microbatches", "m forwards and m backwards"),
        ("return (total - busy) / total", "return (stages - 1) / microbatches", "not by the busy ones"),
        ("        raise ValueError(", "        return 0.0\n        ValueError(", "raise ValueError"),
        ("return (total - busy) / total", "return (total - busy) // total"),
    ],
}

GRADS = {"x": ANY, "w": ANY, "b": ANY}


@case("column_parallel", points=2)
def two_ranks_no_bias_2d_input(student):
    args = (3, 7, 8, (5,), False)
    got = student.spawn(visible._column_yours, world=2, args=args,
                        returns={"y": Tensor("float32"), "local": Tensor("float32"), **GRADS})
    visible.check_column(got, reference(visible._single, *args), 8, world=2)


@case("row_parallel", points=2)
def two_ranks_no_bias(student):
    args = (4, 6, 5, (3, 2), False)
    got = student.spawn(visible._row_yours, world=2, args=args, returns={"y": Tensor("float32"), **GRADS})
    visible.check_row(got, reference(visible._single, *args), 6, world=2)


def _on_ranks_1_and_2(rank, world, fn, harness, args):
    """HARNESS (student's ranks): `harness` as ranks 0 and 1 of 2, run by global ranks 1 and 2 of 3 through the
    sub-group [1, 2]; rank 0 is outside the group (it only takes part in creating it) and returns a dummy."""
    import functools

    import torch
    import torch.distributed as dist

    group = dist.new_group([1, 2])  # every rank creates it, even one outside it
    if rank == 0:
        dummy = {"y": torch.zeros(1), "x": None, "w": None, "b": None}
        return {**dummy, "local": torch.zeros(1)} if harness.__name__ == "_column_yours" else dummy
    return harness(rank - 1, 2, functools.partial(fn, group=group), *args)


@case("column_parallel", points=1)
def ranks_1_and_2_of_3_as_a_group(student):
    args = (5, 6, 4, (2, 3), True)
    got = student.spawn(_on_ranks_1_and_2, world=3, args=(visible._column_yours, args), timeout=60,
                        returns={"y": Tensor("float32"), "local": Tensor("float32"), **GRADS})
    visible.check_column(got[1:], reference(visible._single, *args), 4, world=2)


@case("row_parallel", points=1)
def ranks_1_and_2_of_3_as_a_group_with_a_bias(student):
    args = (7, 6, 5, (4,), True)
    got = student.spawn(_on_ranks_1_and_2, world=3, args=(visible._row_yours, args), timeout=60,
                        returns={"y": Tensor("float32"), **GRADS})
    visible.check_row(got[1:], reference(visible._single, *args), 6, world=2)


def _gpipe_ce_single(seed, microbatches, batch):
    import torch

    model = visible._gpipe_model(seed)[2:]  # Linear 8 -> 8, Tanh, Linear 8 -> 3: inputs 8 wide
    x, t = _ce_data(seed, batch)
    loss = torch.nn.functional.cross_entropy(model(x), t)
    loss.backward()
    return {"loss": float(loss.detach()), "grads": [p.grad for p in model.parameters()]}


def _ce_data(seed, batch):
    import torch

    g = torch.Generator().manual_seed(200 + seed)
    return torch.randn(batch, 8, generator=g), torch.randint(0, 3, (batch,), generator=g)


def _gpipe_ce_yours(rank, world, gpipe_step, seed, microbatches, batch):
    """HARNESS (student's ranks): 2 stages (Linear 8 -> 8, Tanh | Linear 8 -> 3), cross-entropy."""
    import torch

    model = visible._gpipe_model(seed)[2:]
    x, t = _ce_data(seed, batch)
    stage = model[:2] if rank == 0 else model[2:]
    loss = gpipe_step(stage, x if rank == 0 else None, t if rank == 1 else None,
                      torch.nn.functional.cross_entropy, microbatches, (batch // microbatches, 8))
    return {"loss": loss, "grads": [visible._grad(p.grad) for p in stage.parameters()]}


@case("gpipe_step", points=2)
def two_stages_three_micro_batches_cross_entropy(student):
    args = (5, 3, 6)
    got = student.spawn(_gpipe_ce_yours, world=2, args=args, returns={"loss": float | None, "grads": [ANY]})
    want = reference(_gpipe_ce_single, *args)
    assert got[0]["loss"] is None and got[1]["loss"] is not None and abs(got[1]["loss"] - want["loss"]) < 1e-5, \
        (got[0]["loss"], got[1]["loss"])
    refs = [want["grads"][:2], want["grads"][2:]]
    for rank, mine in enumerate(got):
        assert all(visible._same(g, r) for g, r in pairs(mine["grads"], refs[rank], f"stage {rank}'s gradients")), \
            f"stage {rank} gradients"


def _gpipe_group_yours(rank, world, gpipe_step, seed, microbatches, batch):
    """HARNESS (student's ranks): the 2 stages of `_gpipe_ce_yours` on the sub-group [1, 2] of 3 ranks; rank 0
    is outside the group (it only takes part in creating it)."""
    import torch
    import torch.distributed as dist

    group = dist.new_group([1, 2])  # every rank creates it, even one outside it
    if rank == 0:
        return {"loss": None, "grads": []}
    model = visible._gpipe_model(seed)[2:]
    x, t = _ce_data(seed, batch)
    stage = model[:2] if rank == 1 else model[2:]
    loss = gpipe_step(stage, x if rank == 1 else None, t if rank == 2 else None,
                      torch.nn.functional.cross_entropy, microbatches, (batch // microbatches, 8), group=group)
    return {"loss": loss, "grads": [visible._grad(p.grad) for p in stage.parameters()]}


@case("gpipe_step", points=1)
def two_stages_on_ranks_1_and_2_of_3(student):
    args = (6, 2, 4)
    got = student.spawn(_gpipe_group_yours, world=3, args=args, timeout=60,
                        returns={"loss": float | None, "grads": [Either(Tensor("float32"), None)]})
    want = reference(_gpipe_ce_single, *args)
    assert got[1]["loss"] is None and got[2]["loss"] is not None and abs(got[2]["loss"] - want["loss"]) < 1e-5, \
        (got[1]["loss"], got[2]["loss"])
    refs = {1: want["grads"][:2], 2: want["grads"][2:]}
    for rank in (1, 2):
        grads = pairs(got[rank]["grads"], refs[rank], f"stage {rank}'s gradients")
        assert all(visible._same(g, r) for g, r in grads), f"stage {rank} gradients"


def _replayed(p, m):
    """Stage 0's idle share of a GPipe step with unit-time ops, re-timed by labkit's dependency replay."""
    from labkit.viz.pipeline_schedule import measured_bubble, replay

    events = [dict(stage=s, kind=k, mb=i, t0=float(n), t1=float(n) + 1.0) for s in range(p)
              for n, (k, i) in enumerate([("F", i) for i in range(m)] + [("B", i) for i in range(m)])]
    return measured_bubble(replay(events))[0]


@case("bubble_fraction", points=2)
def large_pipelines_and_a_replayed_schedule(student):
    for p, m in ((16, 3), (64, 1000), (5, 5), (2, 1)):
        got = student.call(p, m, returns=float)
        assert abs(got - reference(visible._bubble_reference, p, m)) < 1e-9, (p, m, got)
    assert abs(student.call(4, 6, returns=float) - reference(_replayed, 4, 6)) < 1e-9
    with student.raises(ValueError):
        student.call(-1, 3, returns=float)
