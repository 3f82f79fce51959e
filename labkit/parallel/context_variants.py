"""Context parallelism, three ways, and the zig-zag split that balances the causal mask.

`labkit.parallel.context` trains with the ring over a CONTIGUOUS split. Production systems vary both:

- the SPLIT. Contiguous: rank r holds tokens [r T/n, (r+1) T/n), so under the causal mask rank n-1 attends
  to n blocks and rank 0 to one (its queries see no later keys). ZIG-ZAG (Llama 3, Dubey et al. 2024,
  Sec. 3.3.2; torchtitan's load balancer; Striped Attention, Brandon et al. 2023, strides tokens instead):
  the sequence is cut into 2n chunks and rank r takes chunks r and 2n-1-r, one from each end: every rank
  gets the same causal work.
- the COMMUNICATION. Ring (Liu et al. 2023): K/V blocks pass around the ring n-1 times, overlapped with
  block attention. All-gather-KV (Llama 3, Dubey et al. 2024, Sec. 3.3.2): one all-gather of every rank's
  K/V, then local attention of this rank's queries over all keys -- simpler, exposed, and cheap with GQA
  (few K/V heads). DeepSpeed-Ulysses (Jacobs et al. 2023): an all-to-all turns "my tokens, all heads"
  into "all tokens, my heads", ordinary attention runs per head group, a second all-to-all turns it
  back; needs heads divisible by n, and its volume per rank falls as 1/n (the ring's does not).

All three take this rank's queries/keys/values (B, h, Tc, d) and the GLOBAL positions of its tokens; the
causal mask compares positions, so any split works. Forward only (the notebook compares the outputs with
one device): `context.ring_attention` is the trained path. Bytes per rank for one layer's forward are in
`kv_bytes`, the formulas from `labkit.parallel.comm`. Tested on gloo; NCCL is unverified on hardware.
Introduced in notebook 09_beyond_3d.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.errors import ConfigError, choices_error
from labkit.parallel import comm
from labkit.parallel.context import merge_attention

SPLITS = ("contiguous", "zigzag")
VARIANTS = ("ring", "allgather_kv", "ulysses")


# ------------------------------------------------------------------------------------------ the split
def positions(seq: int, n: int, rank: int, split: str = "contiguous") -> torch.Tensor:
    """The global token positions rank `rank` of `n` holds, in the order it stores them."""
    if split not in SPLITS:
        raise choices_error("context-parallel split", split, SPLITS)
    parts = 2 * n if split == "zigzag" else n
    if seq % parts:
        raise ConfigError(f"seq {seq} does not split into {parts} equal chunks ({split}, cp={n}); "
                          f"use a multiple of {parts}")
    chunks = torch.arange(seq).chunk(parts)
    return chunks[rank] if split == "contiguous" else torch.cat((chunks[rank], chunks[2 * n - 1 - rank]))


def causal_pairs(seq: int, n: int, split: str = "contiguous") -> list[int]:
    """(query, key) pairs each rank's attention computes under the causal mask (per sequence and head) with
    the ring or all-gather-KV: its share of the work. (Ulysses gives each rank all tokens of h/n heads:
    balanced whatever the split.)"""
    out = []
    for r in range(n):
        pos = positions(seq, n, r, split)
        out.append(int((pos + 1).sum()))  # query at position p sees keys 0..p
    return out


def imbalance(work: list[float]) -> float:
    """max / mean: how long the step waits for the busiest rank, relative to a perfect balance (1.0)."""
    return max(work) / (sum(work) / len(work))


def kv_bytes(variant: str, *, seq: int, n: int, heads: int, kv_heads: int, head_dim: int, elem: int = 2) -> float:
    """Bytes one rank sends per sequence for one attention layer's forward."""
    kv = 2 * seq * kv_heads * head_dim * elem  # K and V of the whole sequence
    if variant == "ring":  # n-1 shifts of one K/V block of T/n tokens
        return (n - 1) * kv / n
    if variant == "allgather_kv":
        return comm.bytes_sent("all_gather", kv, n)
    if variant == "ulysses":  # q, k, v in and the output back, each an all-to-all over the local chunk
        local = (heads + 2 * kv_heads + heads) * seq / n * head_dim * elem
        return comm.bytes_sent("all_to_all", local, n)
    raise choices_error("context-parallel variant", variant, VARIANTS)


# ------------------------------------------------------------------------------------------ attention
def masked_attention(q, k, v, q_pos, k_pos, *, scale: float):
    """Causal attention by positions: (out (B,h,Tq,d), lse (B,h,Tq), pairs computed). Rows that see no key
    give out 0 and lse -inf, so `merge_attention` ignores them. The work is the (query, key) pairs computed
    over every sequence and head."""
    q, k, v = q.float(), k.float(), v.float()
    visible = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # (Tq, Tk)
    scores = ((q @ k.transpose(-2, -1)) * scale).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return weights @ v, lse, int(visible.sum()) * q.shape[0] * q.shape[1]  # pairs x sequences x heads


def ring(q, k, v, pos, group, *, scale: float):
    """The ring over any split: K/V and their positions travel; blocks nobody sees are skipped."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out, lse, work = masked_attention(q, k, v, pos, pos, scale=scale)
    kv, kv_pos = torch.stack((k, v)).contiguous(), pos.clone()
    for _ in range(1, n):
        kv, kv_pos = _shift(kv, group, rank, n), _shift(kv_pos, group, rank, n)
        if bool((kv_pos.min() <= pos).any()):  # some query of mine sees some key of the block
            o, l, w = masked_attention(q, kv[0], kv[1], pos, kv_pos, scale=scale)
            out, lse = merge_attention(out, lse, o, l)
            work += w
    return out, work


def allgather_kv(q, k, v, pos, group, *, scale: float):
    """Llama 3's: gather every rank's K/V (and positions) once, then attend locally."""
    n = dist.get_world_size(group)
    kvs = [torch.empty_like(torch.stack((k, v))) for _ in range(n)]
    dist.all_gather(kvs, torch.stack((k, v)).contiguous(), group=group)
    all_pos = [torch.empty_like(pos) for _ in range(n)]
    dist.all_gather(all_pos, pos, group=group)
    kv = torch.cat(kvs, dim=3)  # (2, B, h, T, d)
    out, _, work = masked_attention(q, kv[0], kv[1], pos, torch.cat(all_pos), scale=scale)
    return out, work


def ulysses(q, k, v, pos, group, *, scale: float):
    """DeepSpeed-Ulysses: all-to-all from (my tokens, all heads) to (all tokens, my heads), attention, back."""
    n = dist.get_world_size(group)
    if q.shape[1] % n or k.shape[1] % n:
        raise ConfigError(f"Ulysses splits heads over cp={n}: {q.shape[1]} query / {k.shape[1]} K/V heads "
                          f"do not divide; use ring or all-gather-KV")
    all_pos = [torch.empty_like(pos) for _ in range(n)]
    dist.all_gather(all_pos, pos, group=group)
    all_pos = torch.cat(all_pos)
    qh, kh, vh = (_seq_to_heads(t, group, n) for t in (q, k, v))  # (B, h/n, T, d)
    out, _, work = masked_attention(qh, kh, vh, all_pos, all_pos, scale=scale)
    return _heads_to_seq(out.contiguous(), group, n), work


def _seq_to_heads(x, group, n):
    """(B, h, Tc, d) sequence-sharded -> (B, h/n, n Tc, d) head-sharded, tokens in rank order."""
    send = list(x.chunk(n, dim=1))  # head group j goes to rank j
    recv = [torch.empty_like(send[0]) for _ in range(n)]
    dist.all_to_all(recv, [t.contiguous() for t in send], group=group)
    return torch.cat(recv, dim=2)


def _heads_to_seq(x, group, n):
    send = list(x.chunk(n, dim=2))  # tokens of rank j go back to rank j
    recv = [torch.empty_like(send[0]) for _ in range(n)]
    dist.all_to_all(recv, [t.contiguous() for t in send], group=group)
    return torch.cat(recv, dim=1)


def _shift(x, group, rank, n):
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), dist.get_global_rank(group, (rank + 1) % n), group),
           dist.P2POp(dist.irecv, out, dist.get_global_rank(group, (rank - 1) % n), group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


def compare_rank(rank: int, world: int, seq: int = 32, heads: int = 4, head_dim: int = 8, seed: int = 0) -> dict:
    """On each of `world` gloo ranks (`labkit.course.exercises.spawn`): every (variant, split) on the same
    random q, k, v, against one device's causal attention. Returns the largest difference and the causal
    pairs this rank computed, per 'variant/split'."""
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, seq, head_dim, generator=g) for _ in range(3))
    scale = head_dim ** -0.5
    full = torch.arange(seq)
    reference, _, _ = masked_attention(q, k, v, full, full, scale=scale)
    fns = {"ring": ring, "allgather_kv": allgather_kv, "ulysses": ulysses}
    out = {}
    for split in SPLITS:
        pos = positions(seq, world, rank, split)
        mine = [t[:, :, pos] for t in (q, k, v)]
        for name, fn in fns.items():
            o, work = fn(*mine, pos, group, scale=scale)
            out[f"{name}/{split}"] = {"max_diff": float((o - reference[:, :, pos]).abs().max()), "pairs": work}
    return out
