"""Visible tests of notebook 03_ddp's code exercises (`labkit check`, `ex.check` in the notebook).

Each test spawns 2 gloo ranks once (`spawn`); the rank functions below travel to them by value."""
from labkit.course.exercises import case, spawn

#: LEGACY: these exercises' tests still run in the student's process; port them to `student.call /
#: run / spawn` (docs/grading.md, "Porting a legacy exercise") and remove their names here.
LEGACY = {"average_gradients", "overlap_gradient_averaging", "ring_allreduce"}


def _mlp():
    import torch

    torch.manual_seed(0)  # every rank builds the same replica, as DDP's broadcast would make it
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 4))


def _train_beside_ddp(rank, world, sync, mode, steps, bucket_bytes):
    """Train one replica with the student's gradient sync and one with DDP on this rank's share of
    the same batches; return both per-step global mean losses and the final max weight difference."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(steps, 8, 8, generator=g), torch.randint(0, 4, (steps, 8), generator=g)
    ddp, mine = DistributedDataParallel(_mlp()), _mlp()
    opt_ddp, opt_mine = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ddp, mine))
    finish = sync(mine, None, bucket_bytes) if mode == "overlap" else None
    losses = {"ddp": [], "mine": []}
    for s in range(steps):
        x, y = xs[s, rank::world], ys[s, rank::world]  # this rank's half of the global batch
        for name, model, opt in (("ddp", ddp, opt_ddp), ("mine", mine, opt_mine)):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if name == "mine":
                sync(mine, None) if mode == "after" else finish()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses[name].append(float(mean) / world)
    diff = max(float((p - q).abs().max()) for p, q in zip(ddp.module.parameters(), mine.parameters()))
    return losses, diff


def _assert_same(result, what):
    losses, diff = result
    worst = max(abs(a - b) for a, b in zip(losses["ddp"], losses["mine"]))
    assert worst < 1e-5 and diff < 1e-5, (
        f"{what}: losses differ from DDP's by up to {worst:.2e}, weights by {diff:.2e} after "
        f"{len(losses['ddp'])} steps (DDP {[round(v, 4) for v in losses['ddp']]}, "
        f"yours {[round(v, 4) for v in losses['mine']]})")


@case("average_gradients", points=3)
def losses_equal_ddp_on_2_ranks(average_gradients):
    results = spawn(_train_beside_ddp, world=2, args=(average_gradients, "after", 3, 0), timeout=180)
    _assert_same(results[0], "average_gradients after backward")


@case("overlap_gradient_averaging", points=3)
def losses_equal_ddp_with_small_buckets(overlap_gradient_averaging):
    results = spawn(_train_beside_ddp, world=2, args=(overlap_gradient_averaging, "overlap", 3, 4096),
                    timeout=180)
    _assert_same(results[0], "bucketed all-reduce from hooks (4 KiB buckets)")


def _ring_beside_all_reduce(rank, world, ring_allreduce, n):
    import torch
    import torch.distributed as dist

    t = torch.arange(n, dtype=torch.float32) * (rank + 1) + rank
    want = t.clone()
    dist.all_reduce(want)
    got = ring_allreduce(t)
    return float((t - want).abs().max()), got is not None and float((got - want).abs().max())


@case("ring_allreduce", points=3)
def equals_all_reduce_on_2_ranks(ring_allreduce):
    for rank, (in_place, returned) in enumerate(spawn(_ring_beside_all_reduce, world=2, args=(ring_allreduce, 10),
                                                      timeout=120)):
        assert in_place == 0.0, f"rank {rank}: the tensor after ring_allreduce differs from dist.all_reduce by {in_place}"
        assert returned is not False and returned == 0.0, f"rank {rank}: return the summed tensor"
