"""Sequence parallelism (SP): Megatron-TP with the norm / dropout / residual region split by tokens.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Sec. 4.2.2):
plain TP replicates the residual stream, so the norms, dropouts and residual adds between the TP blocks
run -- and keep their activations -- whole on every rank. SP shards those regions by sequence. An all-reduce
is a reduce-scatter followed by an all-gather, so each of TP's all-reduces (Megatron's g after o_proj and
down_proj) becomes a reduce-scatter INTO the sequence-sharded region and the column-parallel block's input
(Megatron's f) an all-gather OUT of it (backward: the other way round). Same bytes on the wire
(`comm.tp_layer_bytes`: (t-1)/t S for each of RS and AG, 2 (t-1)/t S for the all-reduce), and the
activations of the norm region shrink by t (`labkit.memory.estimate`, `sequence_parallel=True`).

In torch it is DTensor's `SequenceParallel()` on the norms with `ColwiseParallel(input_layouts=Shard(1))`
and `RowwiseParallel(output_layouts=Shard(1))` (`labkit.parallel.tensor.layer_plan(sequence_parallel=True)`).
`compare_rank` runs that plan and plain TP on the same batch beside one device: same loss and gradients,
all-reduces replaced by reduce-scatters + all-gathers, fewer saved activation bytes.

Overlapped TP communication: in both, the collectives sit on the critical path between GEMMs. AsyncTP
(torch `_micro_pipeline_tp`, torchtitan `--parallelism.enable_async_tensor_parallel`, needs torch.compile
and NVLink/SymmetricMemory) decomposes all-gather + matmul and matmul + reduce-scatter into t chunked steps
(Wang et al. 2022, "collective matmul"), computing on one chunk while the next arrives: unverified here
(CPU has neither). Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

import torch


def _saved_bytes():
    """A saved-tensors hook pair counting the LOCAL bytes autograd keeps for backward: parameters themselves
    excluded, but views of them (a transposed weight) counted, so it is an upper bound on the activations."""
    box = {"bytes": 0}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            local = t.to_local() if hasattr(t, "to_local") else t
            box["bytes"] += local.numel() * local.element_size()
        return t

    return box, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def compare_rank(rank: int, world: int, model: str = "tiny-llama", batch: int = 2, seq: int = 16,
                 seed: int = 0) -> dict:
    """On each of `world` gloo ranks: one forward + backward of `model` with plain TP and with TP + SP,
    beside the single-device model. Per variant: loss difference, largest weight-gradient difference,
    collectives (forward, backward) by kind, and the activation bytes this rank saved for backward."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from labkit.zoo.models import build_llm
    from labkit.parallel import tensor as T

    mesh = init_device_mesh("cpu", (world,))
    ref = build_llm(model, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, ref.config.vocab_size, (batch, seq + 1), generator=g)
    inputs, targets = x[:, :-1], x[:, 1:]
    box, hooks = _saved_bytes()
    with hooks:
        ref_loss = F.cross_entropy(ref(inputs).logits.flatten(0, -2), targets.flatten())
    ref_loss.backward()
    ref_loss = ref_loss.detach()
    out = {"single": {"saved_bytes": box["bytes"]}}
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for sp in (False, True):
        tp = T.apply_tensor(build_llm(model, seed=seed), mesh, sequence_parallel=sp)
        box, hooks = _saved_bytes()
        y = {}

        def forward():
            with hooks, loss_parallel():
                y["loss"] = F.cross_entropy(tp(inputs).logits.flatten(0, -2), targets.flatten())

        def backward():
            with loss_parallel():
                y["loss"].backward()

        fwd, bwd = T.count_collectives(forward), T.count_collectives(backward)
        grad_diff = max(float((_full(p.grad) - ref_grads[n]).abs().max()) for n, p in tp.named_parameters())
        out["tp+sp" if sp else "tp"] = {"loss_diff": abs(float(_full(y["loss"]).detach()) - float(ref_loss)),
                                        "grad_diff": grad_diff, "forward": fwd, "backward": bwd,
                                        "saved_bytes": box["bytes"]}
    return out


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t
