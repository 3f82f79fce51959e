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


# ------------------------------------------------------------------ capacity, token dropping, the all-to-all
# GShard (Lepikhin et al. 2021) and Switch (Fedus et al. 2022, Sec. 2.2) give every expert a fixed buffer of
#     capacity C = ceil(capacity_factor x tokens x k / E)
# slots per batch (static shapes for TPUs and for the all-to-all). A token routed to a full expert is DROPPED:
# it skips the layer (only the residual carries it). Factor 1.0 drops whatever exceeds a perfect balance;
# 1.25 (Switch) leaves headroom. Dropless MoE (MegaBlocks, Gale et al. 2023; Mixtral, DeepSeek, torchtitan,
# and labkit's expert-parallel) keeps every token: the all-to-all then carries variable splits, and the
# rank whose experts are popular receives -- and computes -- more than the others: the step waits for it.


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(capacity_factor x tokens x top_k / experts)."""
    import math

    if capacity_factor <= 0:
        from labkit.errors import ConfigError
        raise ConfigError(f"capacity_factor {capacity_factor!r}; it must be > 0 (Switch uses 1.0-1.25)")
    return math.ceil(capacity_factor * tokens * top_k / experts)


def keep_within_capacity(expert_ids: torch.Tensor, experts: int, capacity: int | None) -> torch.Tensor:
    """(T, k) expert choices -> (T, k) bool, True where the slot fits: first come, first served in token
    order (Switch's rule), choice 1 of every token before choice 2. `capacity` None: dropless, all True."""
    if capacity is None:
        return torch.ones_like(expert_ids, dtype=torch.bool)
    order = expert_ids.t().reshape(-1)  # choice-major: every token's first choice first
    onehot = torch.nn.functional.one_hot(order, experts)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # this slot's place in its expert's queue
    return (position < capacity).reshape(expert_ids.shape[1], -1).t()


def route(tokens: int, experts: int, top_k: int, *, skew: float, generator: torch.Generator) -> torch.Tensor:
    """(tokens, top_k) expert ids from a router whose logits favour low-numbered experts by `skew` (0: uniform
    on average; an untrained or collapsing router is skewed)."""
    logits = torch.randn(tokens, experts, generator=generator) - skew * torch.arange(experts) / experts
    return torch.topk(logits, top_k, dim=-1).indices


def dispatch_rank(rank: int, world: int, tokens: int = 256, experts: int = 8, top_k: int = 2, hidden: int = 16,
                  skew: float = 2.0, capacity_factors: tuple = (1.0, 1.25, 2.0), seed: int = 0) -> dict:
    """On each of `world` gloo ranks: route `tokens` local tokens, then run the REAL dispatch all-to-all
    (`all_to_all_single`, variable splits, experts E/world per rank) dropless and at each capacity factor.
    Returns the rows this rank received and the share of its routed slots dropped, per setting."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(seed + rank)
    ids = route(tokens, experts, top_k, skew=skew, generator=g)
    x = torch.randn(tokens, hidden, generator=g)
    local = experts // world
    out = {}
    for cf in (None, *capacity_factors):
        keep = keep_within_capacity(ids, experts, None if cf is None else expert_capacity(tokens, experts, top_k, cf))
        dest = ids[keep] // local  # (slots kept,) destination rank of each routed copy
        rows = x.unsqueeze(1).expand(-1, top_k, -1)[keep][dest.argsort(stable=True)]
        send = torch.bincount(dest, minlength=world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)  # the splits first, as every dropless MoE does
        got = torch.empty(int(recv.sum()), hidden)
        dist.all_to_all_single(got, rows.contiguous(), recv.tolist(), send.tolist())
        out["dropless" if cf is None else f"cf={cf:g}"] = {
            "received_rows": got.shape[0], "dropped": float(1 - keep.float().mean())}
    return out
