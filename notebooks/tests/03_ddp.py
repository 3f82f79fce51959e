"""Visible tests of notebook 03_ddp's code exercises (`ex.check` in the notebook, `labkit check`, `labkit grade`).

Your function runs on 3 gloo ranks (2 ranks hide mistakes that 3 show) in a harness below, which returns
only what it produced: gradients after one backward, tensors after your ring. The expected values are
computed here, in the grader's process: DDP's gradient is the mean of the ranks' gradients (DDP all-reduces
and divides by the world size), all_reduce's result the sum of the ranks' tensors. One spawn per exercise
serves all its tests (`share=True`). Every convention a test checks is in the exercise's docstring.
"""
from labkit.course.exercises import ANY, List, StudentError, Tensor, case, max_error, reference
from labkit.course.exercises.expect import conform

WORLD = 3
LR = 0.1


def _model():
    import torch

    torch.manual_seed(0)  # every rank builds the same replica, as DDP's broadcast would make it
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def _batch(rank, step=0):
    import torch

    g = torch.Generator().manual_seed(100 * step + 10 + rank)  # each rank its own data
    return torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g)


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _backward(model, rank, step=0):
    import torch.nn.functional as F

    x, y = _batch(rank, step)
    F.cross_entropy(model(x), y).backward()


def _ddp_reference(world, steps, lr, groups):
    """What DDP over each group gives (grader's process): per step, every rank's own gradients and, per rank,
    the mean over its group (DDP all-reduces and divides by the group's size); an SGD step between steps."""
    import torch

    models = [_model() for _ in range(world)]
    out = []
    for step in range(steps):
        local = []
        for rank, model in enumerate(models):
            model.zero_grad(set_to_none=True)
            _backward(model, rank, step)
            local.append(_grads(model))
        group_of = {r: g for g in groups for r in g}
        mean = [{k: sum(local[r][k] for r in group_of[rank]) / len(group_of[rank]) for k in local[0]}
                for rank in range(world)]
        out.append({"local": local, "mean": mean})
        with torch.no_grad():
            for rank, model in enumerate(models):
                for name, p in model.named_parameters():
                    p -= lr * mean[rank][name]
    return out


def _close(a, b, tol=1e-6):
    import torch

    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-5, atol=tol))


def _all_close(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(_close(got[k], want[k]) for k in want)


def _ratio(got: dict, want: dict) -> float:
    import torch

    num = torch.cat([got[k].reshape(-1) for k in want]).norm()
    return float(num / torch.cat([w.reshape(-1) for w in want.values()]).norm())


def _scaled(grads: dict, factor: float) -> dict:
    return {k: v * factor for k, v in grads.items()}


def _first_difference(got: dict, want: dict) -> str:
    missing = [k for k in want if k not in got]
    if missing:
        return f"{missing[0]}.grad is None: every trainable parameter needs its averaged gradient"
    name = max(want, key=lambda k: max_error(got[k], want[k]))
    err = max_error(got[name], want[name])
    return f"{name}.grad differs from DDP's by up to {err:.2e} (ratio of norms {_ratio(got, want):.3f})"


def _diagnose(rank, world, got: dict, step_ref: dict, members, after: str) -> str:
    """'' when `got` (one rank's gradients) is DDP's over `members`, else what is off and the fix."""
    want, local = step_ref["mean"][rank], step_ref["local"]
    if _all_close(got, want):
        return ""
    n = len(members)
    where = f"rank {rank} of {world}"
    if _all_close(got, _scaled(want, n)):
        return f"{where}: your gradients are {_ratio(got, want):.2f}x DDP's: divide by the group size ({n})"
    everyone = {k: sum(local[r][k] for r in range(world)) for k in want}
    if n < world:
        for divisor in (n, world):
            if _all_close(got, _scaled(everyone, 1 / divisor)):
                return (f"{where} (in the group {list(members)}): your gradients average over all {world} ranks, "
                        f"not over the group: pass group=group to every collective")
        if _all_close(got, _scaled(want, n / world)):
            return (f"{where} (in the group {list(members)}): your gradients are {_ratio(got, want):.2f}x DDP's: "
                    f"divide by the size of `group` ({n}, dist.get_world_size(group)), not of the whole world")
    for src in members:
        for factor in (1, 1 / n):
            if _all_close(got, _scaled(local[src], factor)):
                whose = "this rank's own gradient" if src == rank else f"rank {src}'s gradient"
                how = "" if factor == 1 else f" divided by {n}"
                return (f"{where}: your gradients are {whose}{how}: all-reduce (sum) every .grad over the group"
                        f"{', not broadcast' if src != rank else ''}, then divide by the group size")
    return f"{where}: {_first_difference(got, want)}{after}"


GRADS = {str: Tensor("float32")}


# ---------------------------------------------------------------- average_gradients
def _average_harness(rank, world, average_gradients, lr):
    """HARNESS (the student's ranks): one backward and your averaging, then one SGD step; then a second model
    averaged over a process group of ranks 0 and 1 only (rank 2 alone in its own). What the second part
    raised is returned as text, so the first part's gradients still reach their test."""
    import torch
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2])]  # every rank creates every group
    model = _model()
    _backward(model, rank)
    average_gradients(model)
    grads = _grads(model)
    torch.optim.SGD(model.parameters(), lr=lr).step()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    sub, error = _model(), ""
    _backward(sub, rank)
    try:
        average_gradients(sub, groups[0] if rank < 2 else groups[1])
    except Exception as exc:  # noqa: BLE001 - reported by the group test
        error = f"{type(exc).__name__}: {exc}"[:300]
    return {"grads": grads, "weights": weights, "group_grads": _grads(sub), "group_error": error}


AVERAGED = {"grads": GRADS, "weights": GRADS, "group_grads": GRADS, "group_error": str}


def _averaged(student):
    return student.spawn(_average_harness, world=WORLD, args=(LR,), returns=AVERAGED, share=True)


@case("average_gradients", points=3)
def gradients_equal_ddps_on_3_ranks(student):
    ref = reference(_ddp_reference, WORLD, 1, LR, [list(range(WORLD))])[0]
    for rank, out in enumerate(_averaged(student)):
        problem = _diagnose(rank, WORLD, out["grads"], ref, range(WORLD),
                            ": all-reduce (sum) every .grad over the group, then divide by the group size")
        assert not problem, problem
    start = {name: p.detach() for name, p in _model().named_parameters()}
    for rank, out in enumerate(_averaged(student)):
        want = {k: start[k] - LR * ref["mean"][rank][k] for k in start}
        assert _all_close(out["weights"], want), (
            f"rank {rank} of {WORLD}: your gradients are DDP's, but after one SGD step (lr {LR}) the weights differ "
            f"from DDP's ({_first_difference(out['weights'], want).replace('.grad', '')}): change only each .grad")


@case("average_gradients", points=1)
def an_explicit_group_averages_over_its_ranks_only(student):
    ref = reference(_ddp_reference, WORLD, 1, LR, [[0, 1], [2]])[0]
    for rank, out in enumerate(_averaged(student)):
        members = [0, 1] if rank < 2 else [2]
        assert not out["group_error"], (f"rank {rank} of {WORLD}, average_gradients(model, group) with the group "
                                        f"{members}: {out['group_error']}")
        problem = _diagnose(rank, WORLD, out["group_grads"], ref, members,
                            f" (group {members}): all-reduce over `group`, divide by its size")
        assert not problem, problem


# ---------------------------------------------------------------- overlap_gradient_averaging
#: Bytes per bucket: [last layer + middle layer] fill one bucket during backward (>= 1000 B); the first
#: layer's 384 B are the last, partial bucket that finish() launches.
BUCKET_BYTES = 1000


def _overlap_harness(rank, world, overlap_gradient_averaging, bucket_bytes, lr, steps):
    """HARNESS (the student's ranks): your hooks on one model, `steps` backwards each followed by your
    finish() and an SGD step; per step the gradients and the all-reduces started before finish(). What a
    step raised is returned as text (and ends the run), so the steps before it still reach their test."""
    import torch
    import torch.distributed as dist

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    finish = overlap_gradient_averaging(model, None, bucket_bytes)
    calls, real, pending = [], dist.all_reduce, {}

    class Waited:
        """An async all-reduce's Work that notes its wait() (a mistake of timing: the sum read before it is there)."""

        def __init__(self, work):
            self._work = work
            pending[id(self)] = True

        def wait(self, *args, **kwargs):
            pending.pop(id(self), None)
            return self._work.wait(*args, **kwargs)

        def __getattr__(self, name):
            if name == "get_future":
                pending.pop(id(self), None)  # waited on through its future
            return getattr(self._work, name)

    def counting(*args, **kwargs):
        calls.append(1)
        work = real(*args, **kwargs)
        return Waited(work) if kwargs.get("async_op") and work is not None else work

    out = []
    dist.all_reduce = counting
    try:
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            calls.clear()
            pending.clear()
            try:
                _backward(model, rank, step)
                during = len(calls)
                finish()
            except Exception as exc:  # noqa: BLE001 - reported by the test of this step
                out.append({"grads": {}, "during_backward": len(calls), "error": f"{type(exc).__name__}: {exc}"[:300],
                            "unwaited": len(pending)})
                break
            out.append({"grads": _grads(model), "during_backward": during, "error": "", "unwaited": len(pending)})
            opt.step()
    finally:
        dist.all_reduce = real
    return out


def _overlapped(student):
    return student.spawn(_overlap_harness, world=WORLD, args=(BUCKET_BYTES, LR, 2), share=True,
                         returns=List({"grads": GRADS, "during_backward": int, "error": str, "unwaited": int}, min=1))


def _overlap_problem(rank, got: dict, step_ref: dict) -> str:
    want, local = step_ref["mean"][rank], step_ref["local"][rank]
    kept = [k for k in want if k in got and not _close(got[k], want[k]) and _close(got[k], local[k])]
    if kept and len(kept) < len(want):
        return (f"rank {rank} of {WORLD}: {', '.join(kept)} keep this rank's own gradient (the other parameters "
                f"match DDP's): finish() must launch the last, partial bucket")
    if len(kept) == len(want):
        return (f"rank {rank} of {WORLD}: every .grad is still this rank's own: finish() must wait for each "
                "all-reduce and copy the averaged values back into each .grad")
    return _diagnose(rank, WORLD, got, step_ref, range(WORLD),
                     ": all-reduce each bucket over the group, then divide by the group size")


@case("overlap_gradient_averaging", points=3)
def gradients_equal_ddps_on_3_ranks_with_small_buckets(student):
    ref = reference(_ddp_reference, WORLD, 2, LR, [list(range(WORLD))])
    for rank, steps in enumerate(_overlapped(student)):
        assert not steps[0]["error"], f"rank {rank} of {WORLD}, first backward and finish(): {steps[0]['error']}"
        unwaited = steps[0]["unwaited"]  # a mistake of timing: its own message, whatever the gradients say
        assert not unwaited, (f"rank {rank} of {WORLD}: finish() returned with {unwaited} async all-reduce(s) never "
                              "waited on: call .wait() on the work each dist.all_reduce(..., async_op=True) returned "
                              "before reading its tensor (async_op returns at once; the sum may not be there yet)")
        problem = _overlap_problem(rank, steps[0]["grads"], ref[0])
        assert not problem, f"first backward ({BUCKET_BYTES} B buckets): {problem}"
        assert len(steps) == 2, f"rank {rank} of {WORLD}: {len(steps)} steps came back from the harness, expected 2"
        assert not steps[1]["error"], (f"rank {rank} of {WORLD}, second backward and finish() (the first was right): "
                                       f"{steps[1]['error']}: finish() must leave the hooks ready for the next "
                                       "backward (an empty bucket, no all-reduce pending)")
        problem = _overlap_problem(rank, steps[1]["grads"], ref[1])
        assert not problem, (f"second backward (the first was right): {problem}; finish() must leave the hooks "
                             "ready for the next backward (an empty bucket, no all-reduce pending)")


@case("overlap_gradient_averaging", points=1)
def all_reduces_start_during_backward(student):
    for rank, steps in enumerate(_overlapped(student)):
        during = steps[0]["during_backward"]
        assert during >= 1, (
            f"rank {rank} of {WORLD}: {during} all-reduces started during backward ({BUCKET_BYTES} B buckets, "
            f"{sum(p.numel() * 4 for p in _model().parameters())} B of gradients): start a bucket's "
            "dist.all_reduce(..., async_op=True) from the hook as soon as it holds >= bucket_bytes")


# ---------------------------------------------------------------- ring_allreduce
#: A length that 3 ranks do not divide: chunks of 6, 6 and 5 elements.
RING_N = 17


def _ring_input(rank, n):
    """Rank r holds (i % 9 + 1) * 10**r at element i: a sum shows each rank's contribution as one digit."""
    import torch

    return (torch.arange(n) % 9 + 1).float() * 10.0 ** rank


def _ring_harness(rank, world, ring_allreduce, n):
    """HARNESS (the student's ranks): your ring on this rank's tensor; the tensor after it and what it returned."""
    import torch

    t = _ring_input(rank, n)
    returned = ring_allreduce(t)
    same = isinstance(returned, torch.Tensor) and returned.data_ptr() == t.data_ptr()
    return {"tensor": t, "returned": returned.detach().clone() if isinstance(returned, torch.Tensor) else None,
            "is_the_input": same}


def _simulated_ring(world, n, walk=(-1, -1), add=True, gather=True):
    """Per-rank results of the docstring's ring, simulated here (grader's process), with a mistake when asked:
    walk[0] / walk[1] the direction the chunk index moves in the reduce-scatter / all-gather (-1 is right),
    add=False overwrites instead of adding, gather=False skips the all-gather."""
    import torch

    data = [list(torch.tensor_split(_ring_input(r, n), world)) for r in range(world)]
    phases = [(walk[0], 0, True, add)] + ([(walk[1], 1, False, False)] if gather else [])
    for sign, shift, reduce, adds in phases:
        for step in range(world - 1):
            sent = [data[r][(r + shift + sign * step) % world].clone() for r in range(world)]
            for r in range(world):
                left = (r - 1) % world
                i = (r + shift + sign * step - 1) % world
                data[r][i] = data[r][i] + sent[left] if adds else sent[left].clone()
    return [torch.cat(chunks) for chunks in data]


#: What the student's tensors equal -> the mistake (each a simulated ring, above) and its fix.
RING_MISTAKES = [
    (dict(walk=(1, -1)), "the chunk index walks the wrong way around the ring in the reduce-scatter: at step s "
                         "rank r sends chunk (r - s) % N and adds what its left neighbour sends into chunk "
                         "(r - s - 1) % N"),
    (dict(walk=(-1, 1)), "the chunk index walks the wrong way around the ring in the all-gather: at step s rank r "
                         "sends chunk (r + 1 - s) % N and receives chunk (r - s) % N"),
    (dict(walk=(1, 1)), "the chunk index walks the wrong way around the ring (in both phases): it must go down "
                        "by one each step, (r - s) % N"),
    (dict(add=False), "the reduce-scatter overwrites: add the received chunk into your own copy (+=), so each "
                      "owned chunk ends as the sum of all N ranks"),
    (dict(gather=False), "only the chunk this rank owns after the reduce-scatter is summed: run the all-gather, "
                         "N-1 more steps passing the summed chunks around"),
]


def _ring_sum(world, n):
    return sum(_ring_input(r, n) for r in range(world))


def _ring_problem(rank, world, n, got) -> str:
    import torch

    want = reference(_ring_sum, world, n)
    if torch.equal(got, want):
        return ""
    i = int((got != want).nonzero()[0])
    where = (f"rank {rank} of {world} holds {float(got[i]):g} at element {i} where all_reduce gives "
             f"{float(want[i]):g} (each digit counts one rank's contribution; length {n}, chunks "
             f"{[len(c) for c in torch.tensor_split(want, world)]})")
    if torch.equal(got, _ring_input(rank, n)):
        return f"{where}: the tensor is unchanged: sum in place, into views of tensor.view(-1), not copies"
    for mistake, fix in RING_MISTAKES:
        if torch.equal(got, reference(_simulated_ring, world, n, **mistake)[rank]):
            return f"{where}: {fix}"
    return f"{where}: compare your chunk indices with the docstring's ring, step by step"


RING = {"tensor": Tensor("float32", (RING_N,)), "returned": ANY, "is_the_input": bool}


#: What a rank's own failure says on a classic mistake of the ring -> the fix (issue #39).
RING_ERRORS = {"size doesn't match": "a rank received a chunk of another size than the receive it posted (chunks "
                                     f"of 6, 6 and 5 for {RING_N} elements): walk the ring one way, send chunk "
                                     "(rank - step) % N to the right neighbour (rank + 1) and receive chunk "
                                     "(rank - step - 1) % N from the left one (rank - 1)"}


def _ringed(student):
    try:
        return student.spawn(_ring_harness, world=WORLD, args=(RING_N,), returns=RING, share=True)
    except StudentError as exc:
        fix = next((fix for symptom, fix in RING_ERRORS.items() if symptom in exc.message), None)
        if fix is None:
            raise
        raise AssertionError(f"{exc.label}: rank {exc.rank if exc.rank is not None else '?'}: {fix} "
                             f"({exc.message.splitlines()[-1][-160:]})") from None


@case("ring_allreduce", points=3)
def equals_all_reduce_on_3_ranks_and_a_length_that_does_not_divide(student):
    for rank, out in enumerate(_ringed(student)):
        problem = _ring_problem(rank, WORLD, RING_N, out["tensor"])
        assert not problem, f"the tensor after ring_allreduce: {problem}"


@case("ring_allreduce", points=1)
def returns_the_summed_input(student):
    for rank, out in enumerate(_ringed(student)):
        assert out["returned"] is not None, f"rank {rank} of {WORLD}: ring_allreduce returned None: return the summed tensor"
        out["returned"] = conform(out["returned"], Tensor("float32", (RING_N,)), f"ring_allreduce on rank {rank}")
        problem = _ring_problem(rank, WORLD, RING_N, out["returned"])
        assert not problem, f"the tensor ring_allreduce returned: {problem}"
        assert out["is_the_input"], (f"rank {rank} of {WORLD}: the returned tensor is a copy: sum in place (chunks "
                                     "that are views of tensor.view(-1)) and return `tensor` itself")
