"""Visible tests of notebook 04_fsdp's code exercises (`ex.check` in the notebook, `labkit check`, `labkit grade`).

Your function runs on gloo ranks in a harness below, which returns only what it produced (gradients,
weights, dtypes seen in forward, what your state holds); the expected values are computed here, in the
grader's process, on one unsharded model: the gradient every data-parallel rank must end with is the mean
of the ranks' own gradients, ZeRO-1's step is plain AdamW on that mean. One spawn per exercise serves all
its tests (`share=True`). Every convention a test checks is in the exercise's docstring.
"""
from labkit.course.exercises import Either, List, Tensor, case, close, like, max_error, pairs, reference
from labkit.course.exercises.expect import conform


def _llama(blocks=2, width=32, vocab=64, seed=0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
                                        num_hidden_layers=blocks, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=32, tie_word_embeddings=False))


def _tokens(rank, vocab=64, length=9, seed=100):
    import torch

    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(seed + rank))


def _loss(model, tokens):
    import torch.nn.functional as F

    logits = model(tokens[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _mean_llama_grads(world):
    """REFERENCE (grader's process): each rank's gradient on the unsharded model, averaged over the ranks."""
    local = []
    for rank in range(world):
        model = _llama()
        _loss(model, _tokens(rank)).backward()
        local.append({name: p.grad.clone() for name, p in model.named_parameters()})
    return {k: sum(g[k] for g in local) / world for k in local[0]}


def _shard_harness(rank, world, shard_model):
    """HARNESS (the student's ranks): your shard_model with an fp32 policy (one backward: gradients,
    placements, units), then with a bf16 policy (the dtype each unit's weights have in forward)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    model = shard_model(_llama(), mesh, MixedPrecisionPolicy())
    params = dict(model.named_parameters())
    _loss(model, _tokens(rank)).backward()
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    out = {"grads": {n: full(p.grad).detach() for n, p in params.items() if p.grad is not None},
           "not_dtensor": [n for n, p in params.items() if not isinstance(p, DTensor)],
           "not_sharded": [n for n, p in params.items()
                           if isinstance(p, DTensor) and (p.device_mesh != mesh or p.placements != (Shard(0),))],
           "units": {name or "<root>": isinstance(m, FSDPModule) for name, m in model.named_modules()
                     if name in ("", "model.layers.0", "model.layers.1")}}
    model = shard_model(_llama(), mesh, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    # The masters as shard_model left them, read BEFORE the forward: a forward that crashes (units with different
    # policies) leaves its units' gathered bf16 copies registered as the parameters.
    masters = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    seen = {}

    def probe(name):
        # A PRE-hook (before the matmul: a unit left in fp32 beside bf16 inputs crashes in it) returning None
        # (a hook's return value would replace the module's input).
        def hook(module, args):
            seen.setdefault(name, str(module.weight.dtype).removeprefix("torch."))
        return hook

    for i, block in enumerate(model.model.layers):
        block.self_attn.q_proj.register_forward_pre_hook(probe(f"model.layers.{i}.self_attn.q_proj"))
    model.lm_head.register_forward_pre_hook(probe("lm_head"))
    try:
        _loss(model, _tokens(rank)).backward()
        error = ""
    except RuntimeError as exc:  # e.g. "expected m1 and m2 to have the same dtype": units with different policies
        error = str(exc).splitlines()[0][:200]
    out.update(compute=seen, masters=masters, bf16_error=error)
    return out


SHARDED = {"grads": {str: Tensor("float32")}, "not_dtensor": [str], "not_sharded": [str], "units": {str: bool},
           "compute": {str: str}, "masters": [str], "bf16_error": str}


#: Imported by the forkserver of warm ranks once, not by every rank (4-5 s of CPU each).
LLAMA = ("transformers.models.llama.modeling_llama",)


def _sharded(student):
    return student.spawn(_shard_harness, world=2, returns=SHARDED, share=True, timeout=180, imports=LLAMA)


@case("shard_model", points=2)
def every_block_and_the_root_are_sharded_units_with_ddps_gradients(student):
    want = reference(_mean_llama_grads, 2)
    for rank, out in enumerate(_sharded(student)):
        assert not out["not_dtensor"], (
            f"rank {rank} of 2: after shard_model {len(out['not_dtensor'])} parameters are plain tensors, not "
            f"sharded DTensors ({', '.join(out['not_dtensor'][:3])}): call fully_shard on the root too (it takes "
            "every parameter no block claimed)")
        assert not out["not_sharded"], (f"rank {rank} of 2: parameters not sharded Shard(0) over the mesh you were "
                                        f"given: {out['not_sharded'][:3]}: pass mesh=mesh to every fully_shard")
        missing = [name for name, unit in out["units"].items() if not unit]
        assert not missing, (f"rank {rank} of 2: {missing} are not FSDP units: fully_shard each block of "
                             "model.model.layers, then the model itself (the gradients can match without it, but "
                             "the whole model is then gathered at once: no memory saved at the peak)")
        got = out["grads"]
        assert set(got) == set(want), f"rank {rank} of 2: no gradient for {sorted(set(want) - set(got))[:3]}"
        like(got, want, f"rank {rank} of 2, fp32 policy: the gradients")  # shapes first: no broadcasting
        name = max(want, key=lambda k: max_error(got[k], want[k]))
        err = max_error(got[name], want[name])
        assert close(got[name], want[name], rtol=1e-4, atol=1e-6), (
            f"rank {rank} of 2, fp32 policy: {name}'s gradient differs by up to {err:.2e} from the mean of the ranks' "
            "gradients, what DDP and apply_fsdp give")


@case("shard_model", points=1)
def every_unit_computes_in_the_policys_dtype(student):
    for rank, out in enumerate(_sharded(student)):
        assert out["masters"] == ["float32"], (
            f"rank {rank} of 2, bf16 policy: the sharded parameters are {out['masters']}: keep the fp32 masters "
            "(the policy casts a gathered copy to bf16 for compute; do not call .to(bfloat16))")
        wrong = {k: v for k, v in out["compute"].items() if v != "bfloat16"}
        blocks = [k for k in wrong if k.startswith("model.layers")]
        assert not blocks, (f"rank {rank} of 2, bf16 policy: {blocks[0]} ran with {wrong[blocks[0]]} weights: "
                            "pass mp_policy=mp_policy to the fully_shard of every block")
        assert not wrong, (f"rank {rank} of 2, bf16 policy: lm_head ran with {wrong.get('lm_head')} weights: pass "
                           "mp_policy=mp_policy to the root's fully_shard too (it owns the embedding and LM head)")
        assert not out["bf16_error"], (f"rank {rank} of 2, bf16 policy: the forward failed ({out['bf16_error']}): "
                                       "pass mp_policy=mp_policy to the fully_shard of every block and of the root")


# ---------------------------------------------------------------- zero1_step
WORLD = 3
STEPS = 3
LR = 0.05
DECAY = 0.1


def _mlp():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))  # 227 parameters


def _mlp_batches(rank, steps):
    import torch

    gen = torch.Generator().manual_seed(rank)
    return [(torch.randn(8, 10, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(steps)]


def _flat(values):
    import torch

    return torch.cat([v.detach().reshape(-1) for v in values])


def _adamw_on_the_mean(world, steps, lr, weight_decay, groups, fresh=False):
    """REFERENCE (grader's process): per rank, plain AdamW on the gradient averaged over the rank's group
    (what DDP + AdamW does); the flat weights after each step and every rank's own first gradients.
    `fresh`: a new AdamW at every step (the mistake of state that forgets the moments and the step count)."""
    import torch
    import torch.nn.functional as F

    group_of = {r: g for g in groups for r in g}
    models = [_mlp() for _ in range(world)]
    opts = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=weight_decay) for m in models]
    batches = [_mlp_batches(r, steps) for r in range(world)]
    weights, first = [[] for _ in range(world)], []
    for step in range(steps):
        local = []
        for rank, model in enumerate(models):
            model.zero_grad()
            x, y = batches[rank][step]
            F.mse_loss(model(x), y).backward()
            local.append([p.grad.clone() for p in model.parameters()])
        if step == 0:
            first = [_flat(g) for g in local]
        for rank, model in enumerate(models):
            members = group_of[rank]
            for i, p in enumerate(model.parameters()):
                p.grad = sum(local[r][i] for r in members) / len(members)
            if fresh:
                opts[rank] = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
            opts[rank].step()
            weights[rank].append(_flat(model.parameters()))
    return {"weights": weights, "first_local": first}


def _zero1_harness(rank, world, zero1_step, steps, lr, weight_decay):
    """HARNESS (the student's ranks): `steps` of your zero1_step on this rank's own data; the flat weights
    after each step, the gradient your slice's AdamW saw first (from its first moment) and your state's bytes."""
    import torch
    import torch.nn.functional as F

    from labkit.course.exercises.handmade import state_bytes

    model, state, weights, seen = _mlp(), {}, [], None
    params = list(model.parameters())
    for step, (x, y) in enumerate(_mlp_batches(rank, steps)):
        F.mse_loss(model(x), y).backward()
        zero1_step(params, state, lr=lr, weight_decay=weight_decay)
        model.zero_grad(set_to_none=True)
        weights.append(_flat(params))
        opts = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
        if step == 0 and len(opts) == 1:
            moments = [s["exp_avg"] for s in opts[0].state.values() if "exp_avg" in s]
            beta1 = opts[0].param_groups[0]["betas"][0]
            seen = moments[0].detach().reshape(-1) / (1 - beta1) if len(moments) == 1 else None
    return {"weights": weights, "first_slice_grad": seen, "state_bytes": state_bytes(state)}


#: Every step's weights (exactly STEPS of them); the first moment is None when `state` holds no single AdamW,
#: and then only the weights decide (a hint, never a skipped check).
ZERO1 = {"weights": List(Tensor("float32", (227,)), STEPS),
         "first_slice_grad": Either(Tensor("float32", (None,)), None), "state_bytes": int}


def _zero1(student):
    return student.spawn(_zero1_harness, world=WORLD, args=(STEPS, LR, DECAY), returns=ZERO1, share=True)


def _slice_problem(rank, seen, ref, size) -> str:
    """What the gradient a rank's AdamW saw first says ('' when it is this rank's slice of the mean)."""
    import torch

    seen = conform(seen, Tensor("float32", (None,)), f"zero1_step on rank {rank}: the AdamW's first moment")
    where = f"rank {rank} of {WORLD}"
    if seen.numel() != size:
        return (f"{where}: your slice holds {seen.numel()} elements; 227 parameters over {WORLD} ranks give slices of "
                f"L = ceil(227 / {WORLD}) = {size} (pad the flat vector to {size * WORLD})")
    mean = torch.nn.functional.pad(sum(ref["first_local"]) / WORLD, (0, size * WORLD - 227))
    own = torch.nn.functional.pad(ref["first_local"][rank], (0, size * WORLD - 227))
    mine = slice(rank * size, (rank + 1) * size)
    close = lambda a, b: bool(torch.allclose(a, b, rtol=1e-4, atol=1e-7))  # noqa: E731
    if close(seen, mean[mine]):
        return ""
    if close(seen, WORLD * mean[mine]):
        return f"{where}: the gradient your slice's AdamW got is {WORLD}.00x the average: divide by the group size"
    for factor, what in ((1, ""), (1 / WORLD, f" divided by {WORLD}")):
        if close(seen, factor * own[mine]):
            return (f"{where}: the gradient your slice's AdamW got is this rank's own{what}: average the flat "
                    "gradients over the group (all-reduce, or reduce-scatter) before the step")
    for other in range(WORLD):
        if other != rank and close(seen, mean[other * size:(other + 1) * size]):
            return (f"{where} stepped elements [{other * size}, {(other + 1) * size}): each rank steps its own "
                    f"slice, [rank * L, (rank + 1) * L) = [{rank * size}, {(rank + 1) * size})")
    err = float((seen - mean[mine]).abs().max())
    return f"{where}: the gradient your slice's AdamW got differs from the average's slice by up to {err:.2e}"


@case("zero1_step", points=3)
def weights_equal_adamw_on_the_averaged_gradients_on_3_ranks(student):
    ref = reference(_adamw_on_the_mean, WORLD, STEPS, LR, DECAY, [list(range(WORLD))])
    size = -(-227 // WORLD)
    outs = _zero1(student)
    for rank, out in enumerate(outs):  # every rank's slice first: a wrong slice on rank 1 is what breaks rank 0's weights
        if out["first_slice_grad"] is not None:
            problem = _slice_problem(rank, out["first_slice_grad"], ref, size)
            assert not problem, problem
    for rank, out in enumerate(outs):
        for step, (got, want) in enumerate(pairs(out["weights"], ref["weights"][rank], f"rank {rank}'s weights")):
            if close(got, want, atol=1e-5):
                continue
            err = max_error(got, want)
            default = reference(_adamw_on_the_mean, WORLD, STEPS, LR, 0.01, [list(range(WORLD))])["weights"][rank]
            fresh = reference(_adamw_on_the_mean, WORLD, STEPS, LR, DECAY, [list(range(WORLD))], True)["weights"]
            fix = ("pass weight_decay=weight_decay to AdamW (its default is 0.01)"
                   if close(got, default[step], atol=1e-6) else
                   "your AdamW starts afresh at every step (a new optimizer forgets its moments and its step "
                   "count): build the slice and its AdamW once, on the first call (`if not state:`), and keep "
                   "them in `state`" if close(got, fresh[rank][step], atol=1e-6) else
                   "all-gather every rank's updated slice and write the whole vector back into the parameters")
            raise AssertionError(f"rank {rank} of {WORLD}: after step {step + 1} (AdamW, lr {LR}, weight decay "
                                 f"{DECAY}) your weights differ from AdamW on the averaged gradients by up to "
                                 f"{err:.2e}: {fix}")


@case("zero1_step", points=1)
def the_state_holds_one_slice(student):
    size = -(-227 // WORLD)
    want = 3 * 4 * size + 4  # fp32 slice + exp_avg + exp_avg_sq, and AdamW's step counter
    for rank, out in enumerate(_zero1(student)):
        got = out["state_bytes"]
        assert 0 < got <= want + want // 4, (
            f"rank {rank} of {WORLD}: your state holds {got:,} B; ZeRO-1 keeps about {want:,} B per rank here: this "
            f"rank's fp32 slice of L = ceil(227 / {WORLD}) = {size} elements and AdamW's two moments of it "
            f"(3 x 4 B x {size}) plus its step counter: keep only this rank's slice and its AdamW in `state`")
