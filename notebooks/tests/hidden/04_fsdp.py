"""Hidden tests of notebook 04_fsdp (run by `labkit grade`; students see only pass/fail per test and VARIES).

Expected values are computed here, in the grader's process (`reference`), on unsharded models."""
from labkit.course.exercises import List, Tensor, case, close, max_error, pairs, reference
from labkit.course.exercises.cases import visible_twin

visible = visible_twin(__labkit_test_file__)  # noqa: F821 - set by the test loader

#: What the hidden tests vary, per exercise: `ex.check` and `labkit check` show this line, nothing else.
VARIES = {
    "shard_model": "3 ranks and a model of 3 blocks",
    "zero1_step": "a process group of 2 of 3 ranks, more steps and another weight decay",
}

#: Classic mistakes. (fragment, replacement, fix): a VISIBLE test must fail with `fix` in its message;
#: (fragment, replacement): any test may catch it (tests/test_exercises_ci.py checks both).
MUTANTS = {
    "shard_model": [
        ("fully_shard(block, mesh=mesh, mp_policy=mp_policy)", "block", "fully_shard each block"),
        ("fully_shard(block, mesh=mesh, mp_policy=mp_policy)", "fully_shard(block, mesh=mesh)",
         "to the fully_shard of every block"),
        ("fully_shard(model, mesh=mesh, mp_policy=mp_policy)", "fully_shard(model, mesh=mesh)",
         "to the root's fully_shard too"),
        ("    fully_shard(model, mesh=mesh, mp_policy=mp_policy)  # ... then the root", "    pass",
         "call fully_shard on the root too"),
    ],
    "zero1_step": [
        ("lo, hi = rank * size, (rank + 1) * size", "lo, hi = 0, size", "each rank steps its own slice"),
        ("dist.all_reduce(grads, group=group)", "grads", "average the flat gradients over the group"),
        ("lr=lr, weight_decay=weight_decay)", "lr=lr)", "pass weight_decay=weight_decay to AdamW"),
        ('state["slice"].grad = grads[lo:hi] / world', 'state["slice"].grad = grads[lo:hi]',
         "divide by the group size"),
        ('        state["adamw"] = torch.optim.AdamW(', '        state["full"] = flat\n        state["adamw"] = torch.optim.AdamW(',
         "keep only this rank's slice"),
        # a mistake of state (issue #39): the optimizer rebuilt every step gets its own message
        ("    if not state:", "    if True:", "starts afresh at every step"),
        ("dist.all_reduce(grads, group=group)", "dist.all_reduce(grads)"),
        ("world, rank = dist.get_world_size(group), dist.get_rank(group)", "world, rank = dist.get_world_size(), dist.get_rank()"),
    ],
}


_llama, _llama_tokens = visible._llama, visible._tokens  # shipped by value with the harness below


def _three_blocks():
    return _llama(blocks=3, width=48, vocab=96, seed=1)


def _tokens(rank):
    return _llama_tokens(rank, vocab=96, length=7, seed=7)


def _grads(world):
    """REFERENCE: the mean over the ranks of each rank's gradient on the unsharded model."""
    local = []
    for rank in range(world):
        model = _three_blocks()
        model(_tokens(rank), labels=_tokens(rank)).loss.backward()
        local.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return {k: sum(g[k] for g in local) / world for k in local[0]}


def _fsdp_harness(rank, world, shard_model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    model = shard_model(_three_blocks(), init_device_mesh("cpu", (world,)), MixedPrecisionPolicy())
    model(_tokens(rank), labels=_tokens(rank)).loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"grads": grads, "units": [isinstance(b, FSDPModule) for b in model.model.layers] + [isinstance(model, FSDPModule)]}


@case("shard_model", points=2)
def three_ranks_three_blocks(student):
    want = reference(_grads, 3)
    for rank, out in enumerate(student.spawn(_fsdp_harness, world=3, timeout=180, imports=visible.LLAMA,
                                             returns={"grads": {str: Tensor("float32")}, "units": List(bool, 4)})):
        assert out["units"] == [True] * 4, (rank, out["units"])
        assert set(out["grads"]) == set(want), rank
        assert close(out["grads"], want, rtol=1e-4, atol=1e-6), rank


def _net():
    import torch

    torch.manual_seed(2)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.ReLU(), torch.nn.Linear(9, 5))  # 113 parameters


def _batch(rank, step):
    import torch

    g = torch.Generator().manual_seed(50 + 10 * rank + step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 5, generator=g)


def _adamw(groups, steps, weight_decay):
    """REFERENCE: per rank, AdamW on the gradient averaged over its group; the final flat weights."""
    import torch
    import torch.nn.functional as F

    out = {}
    for members in groups:
        model = _net()
        opt = torch.optim.AdamW(model.parameters(), lr=0.03, weight_decay=weight_decay)
        for step in range(steps):
            local = []
            for r in members:
                model.zero_grad()
                F.mse_loss(model(_batch(r, step)[0]), _batch(r, step)[1]).backward()
                local.append([p.grad.clone() for p in model.parameters()])
            for i, p in enumerate(model.parameters()):
                p.grad = sum(g[i] for g in local) / len(members)
            opt.step()
        for r in members:
            out[r] = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    return [out[r] for r in sorted(out)]


def _zero1_harness(rank, world, zero1_step, steps, weight_decay):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    groups = [dist.new_group([0, 1]), dist.new_group([2])]
    model, state = _net(), {}
    for step in range(steps):
        x, y = _batch(rank, step)
        F.mse_loss(model(x), y).backward()
        zero1_step(list(model.parameters()), state, lr=0.03, weight_decay=weight_decay,
                   group=groups[0] if rank < 2 else groups[1])
        model.zero_grad(set_to_none=True)
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


@case("zero1_step", points=2)
def a_group_of_2_of_3_ranks_over_5_steps(student):
    want = reference(_adamw, [[0, 1], [2]], 5, 0.3)
    got = student.spawn(_zero1_harness, world=3, args=(5, 0.3), returns=Tensor("float32", (113,)))
    for rank, (mine, ref) in enumerate(pairs(got, want, "the ranks' weights")):
        assert close(mine, ref, atol=1e-5), (rank, max_error(mine, ref))
