"""Hidden tests of notebook 03_ddp (run by `labkit grade`; students see only pass/fail per test)."""
from labkit.course.exercises import case, spawn

#: LEGACY: these exercises' tests still run in the student's process; port them to `student.call /
#: run / spawn` (docs/grading.md, "Porting a legacy exercise") and remove their names here.
LEGACY = {"average_gradients", "overlap_gradient_averaging", "ring_allreduce"}

MUTANTS = {
    "average_gradients": [
        ("            p.grad /= world", "            pass"),
        ("dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)", "dist.broadcast(p.grad, src=0, group=group)"),
    ],
    "overlap_gradient_averaging": [
        ("            flat /= world", "            pass"),
        ("        if sum(p.grad.numel() * p.grad.element_size() for p in bucket) >= bucket_bytes:",
         "        if False:"),
        ("        launch()  # the last, partial bucket", "        pass"),
    ],
    "ring_allreduce": [
        ("        chunks[recv_i] += exchange(send_i, recv_i)", "        chunks[recv_i].copy_(exchange(send_i, recv_i))"),
        ("    for step in range(world - 1):  # all-gather", "    for step in range(0):  # all-gather"),
        ("send_i, recv_i = (rank - step) % world, (rank - step - 1) % world",
         "send_i, recv_i = (rank + step) % world, (rank + step - 1) % world"),
    ],
}


def _mlp(seed=3):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48), torch.nn.Tanh(),
                               torch.nn.Linear(48, 3))


def _grads_beside_ddp(rank, world, sync, mode, bucket_bytes):
    """One backward on a subgroup-free world: (max grad difference to DDP, all_reduce calls made before finish)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    group = dist.new_group(list(range(world)))  # an explicit group: the student must pass it on
    g = torch.Generator().manual_seed(11 + rank)
    x, y = torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g)
    ddp, mine = DistributedDataParallel(_mlp(), process_group=group), _mlp()
    F.cross_entropy(ddp(x), y).backward()
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    finish = sync(mine, group, bucket_bytes) if mode == "overlap" else None
    dist.all_reduce = counting
    try:
        F.cross_entropy(mine(x), y).backward()
        before_finish = len(calls)
        sync(mine, group) if mode == "after" else finish()
    finally:
        dist.all_reduce = real
    diff = max(float((p.grad - q.grad).abs().max()) for p, q in zip(ddp.module.parameters(), mine.parameters()))
    return diff, before_finish, len(calls)


@case("average_gradients", points=2)
def an_explicit_group_and_different_data_per_rank(average_gradients):
    for diff, _, _ in spawn(_grads_beside_ddp, world=2, args=(average_gradients, "after", 0), timeout=180):
        assert diff < 1e-6, diff


@case("overlap_gradient_averaging", points=2)
def all_reduces_start_during_backward(overlap_gradient_averaging):
    for diff, before, total in spawn(_grads_beside_ddp, world=2, args=(overlap_gradient_averaging, "overlap", 1),
                                     timeout=180):
        assert diff < 1e-6, diff
        assert before >= 5, f"{before} all-reduces launched during backward"  # one per 1-byte bucket: 6 tensors


@case("overlap_gradient_averaging", points=1)
def one_big_bucket_is_one_all_reduce(overlap_gradient_averaging):
    for diff, before, total in spawn(_grads_beside_ddp, world=2, args=(overlap_gradient_averaging, "overlap", 2**30),
                                     timeout=180):
        assert diff < 1e-6, diff
        assert before == 0 and total == 1, (before, total)


def _ring_check(rank, world, ring_allreduce, n):
    import torch
    import torch.distributed as dist

    sent = []
    real_isend, real_send = dist.isend, dist.send

    def isend(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return real_isend(tensor, *args, **kwargs)

    def send(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return real_send(tensor, *args, **kwargs)

    g = torch.Generator().manual_seed(rank)
    t = torch.randn(n, generator=g, dtype=torch.float64)
    want = t.clone()
    dist.all_reduce(want)
    dist.isend, dist.send = isend, send
    try:
        ring_allreduce(t)
    finally:
        dist.isend, dist.send = real_isend, real_send
    return float((t - want).abs().max()), sum(sent), t.numel() * t.element_size()


@case("ring_allreduce", points=2)
def three_ranks_and_a_length_that_does_not_divide(ring_allreduce):
    for err, _, _ in spawn(_ring_check, world=3, args=(ring_allreduce, 17), timeout=180):
        assert err < 1e-9, err


@case("ring_allreduce", points=1)
def each_rank_sends_2_n_minus_1_over_n_of_the_tensor(ring_allreduce):
    for err, sent, size in spawn(_ring_check, world=2, args=(ring_allreduce, 4096), timeout=180):
        assert err < 1e-9, err
        assert sent == size, (sent, size)  # 2 (N-1)/N x S = S for N = 2
