"""Hidden tests of notebook 07's exercises: the library's own transforms as references (DTensor's
ColwiseParallel / RowwiseParallel, labkit's pipeline bubble and schedule analysis), other shapes."""
from labkit.course.exercises import case, spawn

#: LEGACY: these exercises' tests still run in the student's process; port them to `student.call /
#: run / spawn` (docs/grading.md, "Porting a legacy exercise") and remove their names here.
LEGACY = {"column_parallel", "row_parallel", "gpipe_step", "bubble_fraction"}

MUTANTS = {
    "column_parallel": [("dist.all_reduce(grad, group=ctx.group)", "grad = grad / 1"),
                        ("return grad.chunk(world, dim=-1)[rank].contiguous(), None",
                         "return grad.chunk(world, dim=-1)[0].contiguous(), None")],
    "row_parallel": [("torch.nn.functional.linear(x_shard, w_shard), group)",
                      "torch.nn.functional.linear(x_shard, w_shard, bias), group)")],
    "gpipe_step": [("y = loss_fn(y, ts[i]) / microbatches", "y = loss_fn(y, ts[i])"),
                   ("dist.send(x.grad.contiguous(), dst=peer(rank - 1), group=group)",
                    "dist.send(torch.zeros_like(x.grad), dst=peer(rank - 1), group=group)")],
    "bubble_fraction": [("total = 2 * (microbatches + stages - 1)", "total = 2 * (microbatches + stages)")],
}


def _dtensor_mlp(rank, torch, plan_for):
    """(reference MLP, DTensor-parallelized copy, mesh): fc1 (8 -> 6), fc2 (6 -> 5)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(3)
    ref = torch.nn.ModuleDict(dict(fc1=torch.nn.Linear(8, 6), fc2=torch.nn.Linear(6, 5)))
    tp = torch.nn.ModuleDict(dict(fc1=torch.nn.Linear(8, 6), fc2=torch.nn.Linear(6, 5)))
    tp.load_state_dict(ref.state_dict())
    mesh = init_device_mesh("cpu", (2,))
    parallelize_module(tp, mesh, plan_for())
    return ref, tp, mesh


@case("column_parallel", points=2)
def column_parallel_matches_dtensor_colwise(column_parallel):
    def rank_fn(rank, world):
        import torch
        from torch.distributed.tensor.parallel import ColwiseParallel

        ref, tp, _ = _dtensor_mlp(rank, torch, lambda: {"fc1": ColwiseParallel()})
        x = torch.randn(2, 3, 8)  # (B, T, in)
        y_dt = tp["fc1"](x)  # this rank's (B, T, 3): ColwiseParallel leaves the output sharded
        y_dt.sum().backward()
        rows = slice(3 * rank, 3 * rank + 3)
        w = ref["fc1"].weight.detach()[rows].clone().requires_grad_()
        b = ref["fc1"].bias.detach()[rows].clone().requires_grad_()
        xx = x.clone().requires_grad_()
        y = column_parallel(xx, w, b, gather_output=False)
        y.sum().backward()
        w_full = w.detach().clone().requires_grad_()
        y_full = column_parallel(x, w_full, b.detach())  # gathered (B, T, 6); a loss that weighs each feature
        (y_full * torch.arange(6.0)).sum().backward()
        (ref["fc1"](x) * torch.arange(6.0)).sum().backward()
        return (torch.allclose(y, y_dt, atol=1e-6) and torch.allclose(y_full, ref["fc1"](x), atol=1e-6)
                and torch.allclose(w_full.grad, ref["fc1"].weight.grad[rows], atol=1e-5)
                and torch.allclose(w.grad, tp["fc1"].weight.grad.to_local(), atol=1e-6)
                and torch.allclose(b.grad, tp["fc1"].bias.grad.to_local(), atol=1e-6)
                and torch.allclose(xx.grad, ref["fc1"].weight.sum(0).expand(2, 3, 8), atol=1e-5))

    assert all(spawn(rank_fn, world=2, timeout=120))


@case("row_parallel", points=2)
def mlp_matches_dtensor_colwise_rowwise(row_parallel):
    def rank_fn(rank, world):
        import torch
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        ref, tp, _ = _dtensor_mlp(rank, torch, lambda: {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        x = torch.randn(4, 8)
        y_dt = tp["fc2"](torch.relu(tp["fc1"](x)))  # Megatron MLP: (4, 5) replicated
        (y_dt * torch.arange(5.0)).sum().backward()
        sl = slice(3 * rank, 3 * rank + 3)
        w1 = ref["fc1"].weight.detach()[sl].clone().requires_grad_()
        w2 = ref["fc2"].weight.detach()[:, sl].clone().requires_grad_()
        b2 = ref["fc2"].bias.detach().clone().requires_grad_()
        h = torch.relu(torch.nn.functional.linear(x, w1, ref["fc1"].bias.detach()[sl]))  # (4, 3) local
        y = row_parallel(h, w2, b2)
        (y * torch.arange(5.0)).sum().backward()
        return (torch.allclose(y, y_dt, atol=1e-5)
                and torch.allclose(w1.grad, tp["fc1"].weight.grad.to_local(), atol=1e-5)
                and torch.allclose(w2.grad, tp["fc2"].weight.grad.to_local(), atol=1e-5)
                and torch.allclose(b2.grad, tp["fc2"].bias.grad.full_tensor(), atol=1e-5))

    assert all(spawn(rank_fn, world=2, timeout=120))


@case("gpipe_step", points=2)
def gpipe_runs_all_forwards_first_on_micro_batches(gpipe_step):
    def rank_fn(rank, world):
        import torch

        torch.manual_seed(4)
        model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
        x, t = torch.randn(6, 5), torch.randint(0, 4, (6,))
        ref = torch.nn.functional.cross_entropy(model(x), t)
        ref.backward()
        ref_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        events = []

        class Recorded(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, a):
                events.append(("F", a.shape[0]))
                out = self.inner(a)
                out.register_hook(lambda g: events.append(("B", g.shape[0])))
                return out

        stage = Recorded(model[:2] if rank == 0 else model[2:])
        loss = gpipe_step(stage, x if rank == 0 else None, t if rank == 1 else None,
                          torch.nn.functional.cross_entropy, 3, (2, 6))
        refs = ref_grads[:2] if rank == 0 else ref_grads[2:]
        grads_ok = all(torch.allclose(p.grad, r, atol=1e-6) for p, r in zip(stage.parameters(), refs))
        order_ok = events == [("F", 2)] * 3 + [("B", 2)] * 3
        loss_ok = loss is None if rank == 0 else abs(loss - ref.item()) < 1e-5
        return grads_ok and order_ok and loss_ok

    assert all(spawn(rank_fn, world=2, timeout=120))


@case("bubble_fraction", points=2)
def bubble_fraction_matches_labkit_and_a_unit_time_schedule(bubble_fraction):
    from labkit.parallel.pipeline import bubble_fraction as reference
    from labkit.viz.pipeline_schedule import measured_bubble, replay

    for p in (1, 2, 3, 5, 8):
        for m in (1, 2, 7, 16):
            assert abs(bubble_fraction(p, m) - reference(p, m)) < 1e-9
    p, m = 4, 6  # GPipe with unit-time ops, re-timed by labkit's dependency replay
    events = [dict(stage=s, kind=k, mb=i, t0=float(n), t1=float(n) + 1.0)
              for s in range(p) for n, (k, i) in enumerate([("F", i) for i in range(m)] + [("B", i) for i in range(m)])]
    stage0 = measured_bubble(replay(events))[0]
    assert abs(bubble_fraction(p, m) - stage0) < 1e-9
    for bad in ((0, 4), (2, 0)):
        try:
            bubble_fraction(*bad)
        except ValueError:
            continue
        raise AssertionError(f"bubble_fraction{bad} did not raise ValueError")
