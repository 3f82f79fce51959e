"""Why a layout cannot run, or does not fit: the planner's checks and their messages (issue 42).

Pure Python, no torch. `check_layout` refuses a layout with the rule it breaks (Narayanan et al. 2021, Sec. 3:
TP inside a node, whole heads per rank, a stage per layer at most...); `no_micro_batching` says why a valid
layout has no micro-batching for the global batch; `overflow` says which term of the memory estimate fills the
GPU -- a layout "does not fit" only when the estimator, with the run's own settings, says so. Used by
`labkit.parallel.planner` (which re-exports them) and `labkit plan`. Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

from labkit.errors import ConfigError
from labkit.parallel.dims import ParallelDims

MICRO_BATCH_SIZES = (1, 2, 4, 8)


def layout_dims(dp: int, tp: int, pp: int, zero: int = 0, *, cp: int = 1, ep: int = 1) -> ParallelDims:
    """The ParallelDims of a layout: with ZeRO the dp ranks shard (dp_shard), without it they replicate."""
    return ParallelDims(dp_replicate=1 if zero else dp, dp_shard=dp if zero else 1, tp=tp, pp=pp, cp=cp, ep=ep)


def check_layout(req, dp: int, tp: int, pp: int, zero: int = 0, *, cp: int = 1, ep: int = 1) -> None:
    """ConfigError naming why (dp, tp, pp, zero, cp, ep) cannot run `req` (a `planner.PlanRequest`); None if it
    can."""
    # "tp(8) * pp(8) * dp(8) = 512 != gpus(64)"
    layout_dims(dp, tp, pp, zero, cp=cp).check_world(req.gpus, label="gpus")
    arch = req.model_spec.arch
    if req.seq % cp:
        raise ConfigError(f"cp={cp} does not split seq={req.seq} into equal chunks; use a cp that divides it")
    experts = arch.get("experts", 0)
    if ep > 1 and (not experts or dp % ep or experts % ep):
        raise ConfigError(f"ep={ep} must divide dp={dp} and the {experts} experts of {req.model} "
                          "(expert parallelism splits the experts over data-parallel ranks)")
    if tp > req.gpus_per_node:
        raise ConfigError(f"tp={tp} > {req.gpus_per_node} GPUs per node: a tensor-parallel group all-reduces "
                          "inside every layer and must sit on one node's NVLink; use tp <= "
                          f"{req.gpus_per_node} and put the rest into pp or dp")
    for key in ("heads", "kv_heads"):
        if arch[key] % tp:
            raise ConfigError(f"tp={tp} does not divide the model's {arch[key]} {key.replace('_', ' ')}: "
                              "every rank needs whole heads")
    if pp > arch["layers"]:
        raise ConfigError(f"pp={pp} > {arch['layers']} layers: every stage needs at least one layer")
    v = req.interleave if pp > 1 else 1
    if v > 1 and arch["layers"] % (pp * v) and (arch["layers"] + 2) % (pp * v):
        raise ConfigError(f"interleave={v} x pp={pp} does not divide the {arch['layers']} layers into equal "
                          "chunks (nor layers + 2, an embedding-only first and an output-only last chunk as in "
                          "Llama 3); choose an interleave that does")
    if dp == 1 and zero:
        raise ConfigError(f"zero={zero} with dp=1 shards over one rank and saves nothing; use zero 0")
    if req.batch % dp:
        raise ConfigError(f"global batch {req.batch} does not split over dp={dp}; use a multiple of {dp}")


#: What to change when a term fills the GPU.
RELIEF = {"weights": "more tp / pp, or zero 3", "grads": "zero 2 or 3, or more tp / pp",
          "optimizer": "zero >= 1 over more ranks, or --optimizer-states bf16",
          "activations": "more recomputation, a smaller micro-batch, or more tp / cp"}


def overflow(est, capacity: float, optimizer_states: str = "fp32") -> str:
    """'' when the estimate fits `capacity` bytes; else the total, the usable memory, the largest term and what
    to change (not bf16 moments if the run already keeps them)."""
    if est.total <= capacity:
        return ""
    terms = {k: getattr(est, k) for k in ("weights", "grads", "optimizer", "activations")}
    big = max(terms, key=terms.get)
    parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in terms.items())
    return (f"{est.total / 1e9:.1f} GB > {capacity / 1e9:.1f} GB usable: {big} ({terms[big] / 1e9:.1f} GB) is the "
            f"largest term ({parts} GB); try " + RELIEF[big].replace(
                ", or --optimizer-states bf16", "" if optimizer_states == "bf16" else ", or --optimizer-states bf16"))


def no_micro_batching(req, dp: int, pp: int, cp: int) -> str:
    """Why a valid (dp, pp, cp) of `req` has no micro-batching: 1F1B needs at least pp micro-batches per pipeline."""
    per_replica = req.batch // dp
    need = f"at least pp={pp}" + (f" (a multiple of pp: interleave {req.interleave})" if req.interleave > 1 else "")
    return (f"{'cp=' + str(cp) + ': ' if cp > 1 else ''}{per_replica} sequences per replica give no micro-batch size "
            f"in {MICRO_BATCH_SIZES} with {need} micro-batches; use --batch {dp * pp * max(1, req.interleave)} "
            "or more")
