"""Hidden tests of notebook 03_ddp (run by `labkit grade`; students see only pass/fail per test and VARIES).

Expected values are computed here, in the grader's process (`reference`): the mean or the sum of what each
rank's data gives, never where the student's code runs."""
from labkit.course.exercises import List, Tensor, case, close, reference

#: What the hidden tests vary, per exercise: `ex.check` and `labkit check` show this line, nothing else.
VARIES = {
    "average_gradients": "frozen parameters (no .grad), another model and 2 ranks",
    "overlap_gradient_averaging": "a process group of 2 of 3 ranks, frozen parameters, 1-byte and 1 GiB buckets "
                                  "(how many all-reduces start during backward)",
    "ring_allreduce": "float64 tensors, a process group whose ranks are not 0..N-1, short tensors, and "
                      "the bytes each rank sends",
}

#: Classic mistakes. (fragment, replacement, fix): a VISIBLE test must fail with `fix` in its message;
#: (fragment, replacement): any test may catch it (tests/test_exercises_ci.py checks both).
MUTANTS = {
    "average_gradients": [
        ("            p.grad /= world", "            pass", "divide by the group size"),
        ("dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)", "dist.broadcast(p.grad, src=0, group=group)",
         "all-reduce (sum) every .grad"),
        ("op=dist.ReduceOp.SUM, group=group)", "op=dist.ReduceOp.SUM)", "pass group=group to every collective"),
        ("world = dist.get_world_size(group)", "world = dist.get_world_size()", "dist.get_world_size(group)"),
        ("if p.grad is not None:", "if True:"),
    ],
    "overlap_gradient_averaging": [
        ("            flat /= world", "            pass", "divide by the group size"),
        ("        if sum(p.grad.numel() * p.grad.element_size() for p in bucket) >= bucket_bytes:",
         "        if False:", "from the hook as soon as it holds >= bucket_bytes"),
        ("        launch()  # the last, partial bucket", "        pass", "launch the last, partial bucket"),
        ("                p.grad.copy_(part.view_as(p.grad))", "                pass",
         "copy the averaged values back into each .grad"),
        ("dist.all_reduce(flat, group=group, async_op=True)", "dist.all_reduce(flat, async_op=True)"),
        # a mistake of timing (issue #39): its own message, not "copy the averaged values back"
        ("            work.wait()\n", "", "never waited on"),
        ("        if p.requires_grad:", "        if True:"),
    ],
    "ring_allreduce": [
        ("chunks = list(torch.tensor_split(tensor.view(-1), world))",
         "chunks = [c.clone() for c in torch.tensor_split(tensor.view(-1), world)]", "not copies"),
        # the ring walked the wrong way for the receives (issue #39: rank 0's abort and its fix, not a peer's reset)
        ("right, left = peers[(rank + 1) % world], peers[(rank - 1) % world]",
         "left, right = peers[(rank + 1) % world], peers[(rank - 1) % world]", "walk the ring one way"),
        ("send_i, recv_i = (rank - step) % world, (rank - step - 1) % world",
         "send_i, recv_i = (rank + step) % world, (rank + step - 1) % world",
         "the chunk index walks the wrong way around the ring"),
        ("        chunks[recv_i] += exchange(send_i, recv_i)", "        chunks[recv_i].copy_(exchange(send_i, recv_i))",
         "add the received chunk into your own copy"),
        ("    for step in range(world - 1):  # all-gather", "    for step in range(0):  # all-gather",
         "run the all-gather"),
        ("    return tensor\n    # END SOLUTION", "    return None\n    # END SOLUTION", "return the summed tensor"),
        ("torch.tensor_split(tensor.view(-1), world)", "torch.chunk(tensor.view(-1), world)"),
        ("right, left = peers[(rank + 1) % world], peers[(rank - 1) % world]",
         "right, left = (rank + 1) % world, (rank - 1) % world"),
    ],
}


def _mlp(frozen: bool):
    import torch

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(7, 24), torch.nn.ReLU(), torch.nn.Linear(24, 24), torch.nn.ReLU(),
                                torch.nn.Linear(24, 2))
    if frozen:
        model[0].requires_grad_(False)
    return model


def _backward(model, rank):
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(31 + rank)
    F.cross_entropy(model(torch.randn(5, 7, generator=g)), torch.randint(0, 2, (5,), generator=g)).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _mean_grads(ranks):
    """DDP's gradient over `ranks` (grader's process): the mean of each rank's own gradient."""
    local = [_backward(_mlp(True), r) for r in ranks]
    return {k: sum(g[k] for g in local) / len(ranks) for k in local[0]}


def _same(got: dict, want: dict) -> bool:
    return close(got, want, rtol=1e-5, atol=1e-6)  # keys, shapes and dtypes first: no broadcasting


GRADS = {str: Tensor("float32")}


def _frozen_harness(rank, world, average_gradients):
    model = _mlp(True)
    _backward(model, rank)
    average_gradients(model)
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@case("average_gradients", points=2)
def frozen_parameters_on_2_ranks(student):
    want = reference(_mean_grads, [0, 1])
    for rank, got in enumerate(student.spawn(_frozen_harness, world=2, returns=GRADS)):
        assert _same(got, want), f"rank {rank}: {sorted(got)} vs {sorted(want)}"


def _overlap_harness(rank, world, overlap_gradient_averaging):
    """A group of ranks 0 and 1 (rank 2 alone) with 1-byte buckets, then the world with one 1 GiB bucket."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2])]
    calls, real = [], dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    out = []
    for group, bucket in ((groups[0] if rank < 2 else groups[1], 1), (None, 2**30)):
        model = _mlp(True)
        finish = overlap_gradient_averaging(model, group, bucket)
        dist.all_reduce = counting
        calls.clear()
        try:
            _backward(model, rank)
            during = len(calls)
            finish()
        finally:
            dist.all_reduce = real
        out.append({"grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                    "during": during, "total": len(calls)})
    return out


@case("overlap_gradient_averaging", points=2)
def a_subgroup_one_byte_and_one_gib_buckets(student):
    runs = student.spawn(_overlap_harness, world=3, returns=List({"grads": GRADS, "during": int, "total": int}, 2))
    for rank, (small, big) in enumerate(runs):
        members = [0, 1] if rank < 2 else [2]
        assert _same(small["grads"], reference(_mean_grads, members)), f"rank {rank}: subgroup gradients"
        assert small["during"] >= 4, f"rank {rank}: {small['during']} all-reduces during backward, 1-byte buckets"
        assert _same(big["grads"], reference(_mean_grads, [0, 1, 2])), f"rank {rank}: 1 GiB bucket gradients"
        assert (big["during"], big["total"]) == (0, 1), (rank, big["during"], big["total"])


def _random(rank, n):
    import torch

    return torch.randn(n, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)


def _ring_harness(rank, world, ring_allreduce):
    """World of 3: float64 of 3000 (bytes sent counted), float64 of 4 (chunks of 2, 1 and 1); then a group of ranks 1 and 2."""
    import torch.distributed as dist

    sent, real = [], dist.isend

    def isend(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    big, small, pair = _random(rank, 3000), _random(rank, 4), _random(rank, 5)
    dist.isend = isend
    try:
        ring_allreduce(big)
    finally:
        dist.isend = real
    ring_allreduce(small)
    group = dist.new_group([1, 2])
    if rank > 0:
        ring_allreduce(pair, group)
    return {"big": big, "sent": sum(sent), "small": small, "pair": pair}


def _sums(ranks, n):
    return sum(_random(r, n) for r in ranks)


@case("ring_allreduce", points=2)
def float64_a_group_a_short_tensor_and_the_bytes_sent(student):
    import torch

    out = student.spawn(_ring_harness, world=3, returns={"big": Tensor("float64", (3000,)), "sent": int,
                                                         "small": Tensor("float64", (4,)),
                                                         "pair": Tensor("float64", (5,))})
    for rank, got in enumerate(out):
        assert close(got["big"], reference(_sums, [0, 1, 2], 3000), atol=1e-12), f"rank {rank}: 3000"
        assert close(got["small"], reference(_sums, [0, 1, 2], 4), atol=1e-12), f"rank {rank}: 4"
        assert got["sent"] == 2 * 2 * 1000 * 8, f"rank {rank} sent {got['sent']} B, 2 (N-1)/N x 24000 = 32000"
        if rank > 0:
            assert close(got["pair"], reference(_sums, [1, 2], 5), atol=1e-12), f"rank {rank}: group [1, 2]"
