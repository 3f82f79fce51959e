"""Visible tests of notebook 07's exercises (tensor and pipeline parallelism by hand).

Each multi-rank test runs one 2-rank gloo group (`spawn`) and compares with the single-device model
computed on every rank from the same weights (Megatron's TP and GPipe only reorganise the work).
"""
from labkit.course.exercises import case, spawn

#: LEGACY: these exercises' tests still run in the student's process; port them to `student.call /
#: run / spawn` (docs/grading.md, "Porting a legacy exercise") and remove their names here.
LEGACY = {"column_parallel", "row_parallel", "gpipe_step", "bubble_fraction"}


@case("column_parallel", points=2)
def column_parallel_equals_the_full_linear(column_parallel):
    def rank_fn(rank, world):
        import torch

        torch.manual_seed(0)
        full = torch.nn.Linear(6, 4)  # out = 4 features: 2 per rank
        x = torch.randn(3, 6, requires_grad=True)
        y_ref = full(x)
        y_ref.square().sum().backward()
        rows = slice(2 * rank, 2 * rank + 2)
        w = full.weight.detach()[rows].clone().requires_grad_()
        b = full.bias.detach()[rows].clone().requires_grad_()
        xx = x.detach().clone().requires_grad_()
        y = column_parallel(xx, w, b)
        y.square().sum().backward()
        local = column_parallel(x.detach(), w.detach(), b.detach(), gather_output=False)
        return dict(y=torch.allclose(y, y_ref, atol=1e-6), x_grad=torch.allclose(xx.grad, x.grad, atol=1e-6),
                    w_grad=torch.allclose(w.grad, full.weight.grad[rows], atol=1e-6),
                    b_grad=torch.allclose(b.grad, full.bias.grad[rows], atol=1e-6),
                    local=tuple(local.shape) == (3, 2) and torch.allclose(local, y_ref[:, rows], atol=1e-6))

    for rank, got in enumerate(spawn(rank_fn, world=2, timeout=120)):
        bad = [k for k, ok in got.items() if not ok]
        assert not bad, (f"rank {rank}: {', '.join(bad)} differ from the single-device Linear "
                         "(y: gathered output; x_grad: the input gradient must be all-reduced in the backward; "
                         "local: gather_output=False returns this rank's (..., out/t) slice)")


@case("row_parallel", points=2)
def row_parallel_equals_the_full_linear(row_parallel):
    def rank_fn(rank, world):
        import torch

        torch.manual_seed(1)
        full = torch.nn.Linear(6, 4)  # in = 6 features: 3 per rank
        x = torch.randn(5, 6, requires_grad=True)
        full(x).square().sum().backward()
        cols = slice(3 * rank, 3 * rank + 3)
        xs = x.detach()[:, cols].clone().requires_grad_()
        w = full.weight.detach()[:, cols].clone().requires_grad_()
        b = full.bias.detach().clone().requires_grad_()
        y = row_parallel(xs, w, b)
        y.square().sum().backward()
        return dict(y=torch.allclose(y, full(x.detach()), atol=1e-6),
                    x_grad=torch.allclose(xs.grad, x.grad[:, cols], atol=1e-6),
                    w_grad=torch.allclose(w.grad, full.weight.grad[:, cols], atol=1e-6),
                    bias_grad=torch.allclose(b.grad, full.bias.grad, atol=1e-6))

    for rank, got in enumerate(spawn(rank_fn, world=2, timeout=120)):
        bad = [k for k, ok in got.items() if not ok]
        assert not bad, (f"rank {rank}: {', '.join(bad)} differ from the single-device Linear (sum the partial "
                         "products over the ranks, add the bias once)")


@case("gpipe_step", points=3)
def gpipe_loss_and_grads_equal_single_device(gpipe_step):
    def rank_fn(rank, world):
        import torch

        torch.manual_seed(2)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        x, t = torch.randn(8, 4), torch.randn(8, 3)
        loss_fn = torch.nn.functional.mse_loss
        ref = loss_fn(model(x), t)
        ref.backward()
        ref_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        stage = model[:2] if rank == 0 else model[2:]
        loss = gpipe_step(stage, x if rank == 0 else None, t if rank == 1 else None, loss_fn, 4, (2, 8))
        grads = [p.grad for p in stage.parameters()]
        refs = ref_grads[:2] if rank == 0 else ref_grads[2:]
        ok = all(g is not None and torch.allclose(g, r, atol=1e-6) for g, r in zip(grads, refs))
        return dict(loss=loss, ref=ref.item(), grads=ok)

    first, last = spawn(rank_fn, world=2, timeout=120)
    assert first["loss"] is None, f"the first stage returned {first['loss']!r}; only the last stage returns the loss"
    assert last["loss"] is not None and abs(last["loss"] - last["ref"]) < 1e-5, (
        f"pipeline loss {last['loss']!r} != single-device loss {last['ref']:.6f} (sum of loss_fn(...) / microbatches)")
    assert first["grads"] and last["grads"], (
        f"gradients differ from the single-device model's (stage 0 {first['grads']}, stage 1 {last['grads']})")


@case("bubble_fraction", points=1)
def bubble_fraction_matches_the_closed_form(bubble_fraction):
    for p, m in ((1, 4), (2, 2), (4, 8)):
        want = (p - 1) / (m + p - 1)
        got = bubble_fraction(p, m)
        assert abs(got - want) < 1e-9, f"bubble_fraction({p}, {m}) = {got!r}, expected {want:.4f}"
