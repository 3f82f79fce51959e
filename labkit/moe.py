"""Mixture of experts: the load-balancing loss the training task adds for MoE models (`tiny-moe`).

A top-k router sends each token to k of E experts (Shazeer et al. 2017; Mixtral, Jiang et al. 2024:
E = 8, k = 2). Left alone it collapses onto a few experts, so training adds the auxiliary loss of
Switch Transformers (Fedus et al. 2022, Eq. 4-6; GShard, Lepikhin et al. 2021):

    aux = E * sum_i f_i * P_i       f_i = fraction of the k routing slots that picked expert i
                                    P_i = mean router probability of expert i

which is 1 for a perfectly uniform router (f_i = P_i = 1/E) and grows as the load concentrates
(f_i carries no gradient: the router learns through P_i). The loss of a step is
cross-entropy + `router_aux_loss_coef` x aux, averaged over layers.

We compute f and P per SEQUENCE and average over the batch (DeepSeek-V3's "sequence-wise" balance
loss, Liu et al. 2024, Eq. 17-20) instead of over the whole batch as Switch does: the loss is then
a mean over samples like the cross-entropy, so data-parallel and expert-parallel runs, whose ranks
each see part of the batch, get exactly the single-process loss and gradients. Introduced in
notebook 09_beyond_3d.
"""
from __future__ import annotations

import torch


def balance_loss(router_logits, *, top_k: int, batch: int) -> torch.Tensor:
    """Sequence-wise Switch/GShard balance loss from each layer's router logits ((B*T, E) each)."""
    per_layer = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1).unflatten(0, (batch, -1))  # (B, T, E)
        experts = probs.shape[-1]
        chosen = torch.topk(probs, top_k, dim=-1).indices  # (B, T, k)
        counts = torch.zeros_like(probs).scatter_(-1, chosen, 1.0).sum(dim=1)  # (B, E) slots per expert
        f = counts / (top_k * probs.shape[1])  # (B, E), sums to 1 per sequence
        p = probs.mean(dim=1)  # (B, E)
        per_layer.append(experts * (f * p).sum(-1).mean())  # mean over sequences
    return torch.stack(per_layer).mean()


def moe_facts(config) -> dict:
    """(experts, top_k, aux coefficient) of an HF config: zeros for a dense model."""
    experts = getattr(config, "num_local_experts", 0) or 0
    return {"experts": experts, "top_k": getattr(config, "num_experts_per_tok", 0) if experts else 0,
            "aux_coef": float(getattr(config, "router_aux_loss_coef", 0.0)) if experts else 0.0}
