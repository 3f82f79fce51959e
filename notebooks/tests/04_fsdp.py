"""Visible tests of notebook 04's exercises (shard_model, zero1_step). Each spawns 2 gloo ranks once."""
from labkit.course.exercises import case, spawn
from labkit.course.exercises.handmade import zero1_vs_adamw

#: LEGACY: these exercises' tests still run in the student's process; port them to `student.call /
#: run / spawn` (docs/grading.md, "Porting a legacy exercise") and remove their names here.
LEGACY = {"shard_model", "zero1_step"}


def _tiny_llama_losses(model, steps=3, lr=1e-2):
    """AdamW steps on this rank's fixed token batch; the losses averaged over the ranks."""
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    tokens = torch.randint(0, model.config.vocab_size, (2, 17), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    mean = torch.stack(losses)
    dist.all_reduce(mean)
    return (mean / dist.get_world_size()).tolist()


def _fsdp_rank(rank, world, shard_model):
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor, Shard

    from labkit.models import build_llm
    from labkit.parallel.fsdp import apply_fsdp

    mesh = init_device_mesh("cpu", (world,))
    theirs = apply_fsdp(build_llm("tiny-llama", seed=0), mesh, cfg=SimpleNamespace(amp="none"))
    mine = shard_model(build_llm("tiny-llama", seed=0), mesh, MixedPrecisionPolicy())
    params = dict(mine.named_parameters())
    return {
        "labkit": _tiny_llama_losses(theirs),
        "mine": _tiny_llama_losses(mine),
        "not_dtensor": [n for n, p in params.items() if not isinstance(p, DTensor)],
        "not_sharded": [n for n, p in params.items()
                        if isinstance(p, DTensor) and (p.device_mesh != mesh or p.placements != (Shard(0),))],
        "units": {name or "<root>": isinstance(m, FSDPModule) for name, m in mine.named_modules()
                  if name in ("", "model.layers.0", "model.layers.1")},
    }


@case("shard_model", points=2)
def losses_match_labkit_fsdp(shard_model):
    out = spawn(_fsdp_rank, world=2, args=(shard_model,), timeout=180)[0]
    assert not out["not_dtensor"], (
        f"after shard_model these parameters are plain tensors, not sharded DTensors: {out['not_dtensor'][:4]}; "
        "call fully_shard on the root too (it takes every parameter no block claimed)")
    assert not out["not_sharded"], (
        f"parameters not sharded as Shard(0) over the mesh you were given: {out['not_sharded'][:4]}")
    worst = max(abs(a - b) for a, b in zip(out["mine"], out["labkit"]))
    assert worst < 1e-5, (f"losses differ from labkit's apply_fsdp by up to {worst:.2e}: "
                          f"yours {out['mine']}, labkit {out['labkit']}")
    missing = [name for name, unit in out["units"].items() if not unit]
    assert not missing, (f"{missing} are not FSDP units: fully_shard each block of model.model.layers, "
                         "then the model itself (the losses can match without it, but the whole model is "
                         "then gathered at once: no memory saved at the peak)")


_RESULTS: dict = {}


def zero1_results(zero1_step, steps=3, weight_decay=0.0):
    """Per-rank results of `_zero1_rank`; both tests of one function share one spawn."""
    key = (id(zero1_step), steps, weight_decay)
    if key not in _RESULTS:
        _RESULTS[key] = (zero1_step, spawn(zero1_vs_adamw, world=2, args=(zero1_step, steps, weight_decay), timeout=120))
    return _RESULTS[key][1]


@case("zero1_step", points=2)
def params_equal_plain_adamw(zero1_step):
    for rank, out in enumerate(zero1_results(zero1_step)):
        err = float((out["sharded"] - out["ref"]).abs().max())
        assert err < 1e-5, (f"rank {rank}: after 3 steps your parameters differ from AdamW on the averaged "
                            f"gradients by up to {err:.2e} (did every rank all-gather every slice, and "
                            "average the gradients over the ranks?)")


@case("zero1_step", points=2)
def state_bytes_halve_on_two_ranks(zero1_step):
    for rank, out in enumerate(zero1_results(zero1_step)):
        alone, sharded = out["bytes_alone"], out["bytes_sharded"]
        assert alone > 0 and sharded > 0, (
            f"rank {rank}: your state dict holds {sharded} bytes (2 ranks) and {alone} bytes (1 rank): keep the "
            "slice and its AdamW in `state` so they live across steps")
        assert float((out["alone"] - out["ref"]).abs().max()) < 1e-5, (
            f"rank {rank}: on a one-rank group your step does not equal plain AdamW")
        assert sharded <= 0.55 * alone, (
            f"rank {rank}: your state holds {sharded} bytes on 2 ranks vs {alone} bytes on 1 rank; ZeRO-1 keeps "
            "only this rank's slice (and AdamW's moments of it): about half")
