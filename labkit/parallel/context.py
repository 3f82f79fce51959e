"""Context parallelism: the sequence split over ranks, attention computed with ring attention.

Liu et al. 2023, "Ring Attention with Blockwise Transformers": rank r holds tokens
[r T/n, (r+1) T/n) of every sequence. Everything but attention is per token, so it runs on the local
chunk as is; attention needs every earlier key and value. The ranks form a ring: each one computes
attention of its queries against the K/V block it holds, passes that block to the next rank and
receives one from the previous, n - 1 times, and merges the partial results with the online softmax
(Milakov & Gimelshein 2018; the same merge FlashAttention does between tiles):

    block attention: o_b = softmax(q k_b^T * s) v_b  (B,h,Tq,d),  lse_b = logsumexp(q k_b^T * s)  (B,h,Tq)
    merge:           lse = log(e^lse_a + e^lse_b),   o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b

`merge_attention` is that step (the exercise of notebook 09_beyond_3d). Activations per rank shrink
by n; the K/V bytes moved per layer and rank are (n - 1)/n x 2 T h_kv d x bytes, overlappable with
the block computations on a GPU (not here: this ring is blocking and readable).

Causal mask across blocks with a CONTIGUOUS split: queries of rank r see all keys of ranks < r, the
causal triangle of their own block, and nothing of ranks > r. So rank n-1 does n blocks of work and
rank 0 one: the load is unbalanced (the zig-zag split of Llama 3 / torchtitan gives each rank a
chunk from both ends; not in this trained ring: `labkit.parallel.context_variants` runs it, forward only). Rotary embeddings must see GLOBAL positions, so the
model gets `position_ids = r T/n + arange(T/n)`.

Backward: the ring pass is an autograd function whose backward passes the gradient the other way,
so autograd differentiates the whole ring (dK/dV travel back to the rank that owns the block). Each
rank then holds its chunk's share of every weight gradient; the full-sequence gradient is their
mean (equal chunks, mean loss), averaged with one all-reduce per step like DDP.

torch's own `torch.distributed.tensor.experimental.context_parallel` dispatches on the CUDA
flash / efficient / cuDNN SDPA kernels only (CPU SDPA uses another op), so it does not run on our
CPU ranks; on a GPU node it is the production path. This ring runs over NCCL unchanged (isend/irecv),
but is tested on gloo only: NCCL runs and bf16 (which it computes in fp32) are unverified on
hardware. Introduced in notebook 09_beyond_3d.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from labkit.errors import ConfigError
from labkit.parallel import comm
from labkit.parallel.single import Strategy

ATTN_NAME = "labkit_ring"


def apply_context_parallel(model: nn.Module, group, *, cfg=None) -> nn.Module:
    """Make an HF causal LM compute on this rank's sequence chunk with ring attention over `group`.

    In place: every attention layer uses `ring_attention` (registered as a transformers attention
    implementation) and a forward pre-hook gives the model the chunk's global `position_ids`. The
    caller feeds `split_sequence(inputs, rank, n)` and averages gradients over `group`.
    """
    from transformers import AttentionInterface

    if group is None:
        raise ConfigError("context-parallel needs a process group: launch with --nproc N (torchrun)")
    AttentionInterface.register(ATTN_NAME, _hf_ring_attention)
    model.config._attn_implementation = ATTN_NAME
    for module in model.modules():
        if hasattr(module, "num_key_value_groups"):  # attention layers: the ring they talk over
            module.labkit_cp_group = group
    rank, n = dist.get_rank(group), dist.get_world_size(group)

    def global_positions(_module, args, kwargs):
        inputs = args[0] if args else kwargs["input_ids"]
        t = inputs.shape[1]
        kwargs.setdefault("position_ids", (rank * t + torch.arange(t, device=inputs.device)).unsqueeze(0))
        kwargs["use_cache"] = False
        return args, kwargs

    model.register_forward_pre_hook(global_positions, with_kwargs=True)
    model.labkit_cp = {"cp": n, "rank": rank}
    return model


def split_sequence(x: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s contiguous chunk of the sequence dim (dim 1) of (B, T, ...) `x`."""
    return x.chunk(n, dim=1)[rank]


# ------------------------------------------------------------------------------------------ the math
def block_attention(q, k, v, *, scale: float, causal: bool):
    """Attention of queries q (B,h,Tq,d) on one K/V block (B,h,Tk,d): output (B,h,Tq,d) and lse (B,h,Tq).

    In fp32 whatever the autocast (FlashAttention also keeps its softmax statistics in fp32)."""
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = q.float(), k.float(), v.float()
        scores = (q @ k.transpose(-2, -1)) * scale  # (B, h, Tq, Tk)
        if causal:  # the diagonal block: query i sees keys 0..i
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # (B, h, Tq)
        return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Online-softmax merge of two partial attentions over disjoint key sets (the student's exercise).

    out_* (B,h,T,d) are softmax-normalised within their own keys, lse_* (B,h,T) the log of their
    normaliser. The result is attention over the union of both key sets, and its lse.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    return out, lse


class _RingShift(torch.autograd.Function):
    """Send to the next rank, receive from the previous one; backward: the same, the other way."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _shift(x, group, +1)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad.contiguous(), ctx.group, -1), None


def _shift(x: torch.Tensor, group, direction: int) -> torch.Tensor:
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    to = dist.get_global_rank(group, (rank + direction) % n)
    frm = dist.get_global_rank(group, (rank - direction) % n)
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), to, group), dist.P2POp(dist.irecv, out, frm, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


def ring_attention(q, k, v, group, *, scale: float, kv_groups: int = 1) -> torch.Tensor:
    """Causal attention of this rank's queries over the keys of every rank up to it (contiguous split).

    q (B,h,Tc,d); k, v (B,h_kv,Tc,d) of this rank's chunk (GQA: h = kv_groups x h_kv, repeated after
    the ring so the smaller K/V travel). Returns (B,h,Tc,d).
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    kv = torch.stack((k, v))  # (2, B, h_kv, Tc, d): one message per ring step
    out, lse = block_attention(q, *_expand(kv, kv_groups), scale=scale, causal=True)
    for step in range(1, n):
        kv = _RingShift.apply(kv, group)  # now the block of rank (rank - step) mod n
        if (rank - step) % n < rank:  # an earlier chunk: every key visible
            out, lse = merge_attention(out, lse, *block_attention(q, *_expand(kv, kv_groups), scale=scale,
                                                                 causal=False))
        else:  # a later chunk, fully masked. Keep the block in the graph so this rank also runs its
            out = out + 0.0 * kv.sum()  # backward shift: the ring's backward is collective too.
    return out


def _expand(kv: torch.Tensor, groups: int):
    k, v = kv.unbind(0)
    return (k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)) if groups > 1 else (k, v)


def _hf_ring_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature; returns (B, Tc, h, d) like its sdpa path."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ring_attention(query, key, value, module.labkit_cp_group, scale=scale,
                         kv_groups=getattr(module, "num_key_value_groups", 1))
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


def average_gradients(model: nn.Module, group) -> None:
    """Mean of each parameter's gradient over `group` (sum, then divide: gloo has no AVG)."""
    n = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(n)


# ------------------------------------------------------------------------------------------ hook
class ContextParallelStrategy(Strategy):
    """Hook for 'context-parallel': every rank reads the SAME global batch (dp = 1) and trains on its
    sequence chunk; gradients are averaged over the ranks after the last micro-batch."""

    @classmethod
    def check(cls, cfg, world_size: int) -> None:
        if cfg.kind != "llm":
            raise ConfigError(f"context-parallel splits token sequences; {cfg.run.model!r} is not an LLM: "
                              "use --model tiny-llama")
        from labkit.zoo.models import llm_config
        if getattr(llm_config(cfg.run.model), "num_local_experts", 0):
            raise ConfigError(f"context-parallel runs dense models (the MoE balance loss is per whole sequence); "
                              f"{cfg.run.model!r} has experts: use --strategy expert-parallel, or --model tiny-llama")
        if cfg.run.seq_len % world_size:
            raise ConfigError(f"--seq-len {cfg.run.seq_len} does not split into {world_size} equal chunks; "
                              f"use a multiple of {world_size}")
        if cfg.precision.compile:
            raise ConfigError("context-parallel's ring does point-to-point sends inside attention; "
                              "run it without --compile")
        super().check(cfg, world_size)

    def wrap(self, model: nn.Module) -> nn.Module:
        return apply_context_parallel(model, self.ctx.group, cfg=self.cfg)

    def train_step(self, micro_batches: list, loss_fn):
        r, n = self.ctx.rank, self.ctx.world_size
        local = [(split_sequence(x, r, n), split_sequence(y, r, n)) for x, y in micro_batches]
        loss = super().train_step(local, loss_fn)
        return loss  # this chunk's mean loss: the loop's mean over ranks is the full sequence's

    def optimizer_step(self) -> None:
        average_gradients(self.model, self.ctx.group)
        super().optimizer_step()

    def eval_logits(self, inputs, targets):
        r, n = self.ctx.rank, self.ctx.world_size
        local = super().eval_logits(split_sequence(inputs, r, n), None).contiguous()  # (B, Tc, V)
        parts = [torch.empty_like(local) for _ in range(n)]
        dist.all_gather(parts, local, group=self.ctx.group)
        return torch.cat(parts, dim=1)  # (B, T, V), the same on every rank

    def record_facts(self) -> dict:
        from labkit.facts import ContextFacts
        cfg = self._unwrapped().config
        kv_bytes = 2 * self.cfg.run.seq_len * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
        n = self.ctx.world_size
        return {**super().record_facts(), "context": ContextFacts(
            cp=n, cp_split="contiguous", ring_kv_bytes_per_layer_per_sample=int(comm.bytes_sent("all_gather", kv_bytes, n)))}


STRATEGY_CLASSES = {"context-parallel": ContextParallelStrategy}
