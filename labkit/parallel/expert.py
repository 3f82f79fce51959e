"""Expert parallelism: each rank holds E/N of a mixture-of-experts layer's experts; tokens travel.

GShard (Lepikhin et al. 2021, Sec. 2.2) and Switch Transformers (Fedus et al. 2022, Sec. 2.2):
attention, norms, embeddings and the routers are data parallel (a replica per rank, gradients
averaged); the experts are split over the ranks. In every MoE layer, each token picks its top-k
experts on its own rank, then two all-to-alls move it:

    dispatch  x (N,H) --sort the N*k (token, expert) slots by expert--> send to the expert's owner
              all_to_all_single(splits = slots per destination rank) -> (M,H) tokens for MY experts
    experts   the rank's E/N experts run on the tokens they received (HF's own expert kernels)
    combine   the reverse all_to_all_single brings each result home; weight by the router's score and
              sum the k slots of each token -> (N,H)

Per layer and micro-batch each rank sends and receives (N-1)/N x N_tokens x k x H activations twice
forward and twice backward (the all-to-all is its own transpose: its backward is the reverse
all-to-all). Expert weights, gradients and optimizer states per rank are 1/N of the experts.

Gradients, so the update equals the single-process one: every rank's loss is the mean over its B/N
samples, the global loss the mean of those. Dense gradients are therefore AVERAGED over the ranks
(all-reduce / N, as DDP does); an expert's gradient already SUMS the contributions of every rank's
tokens (they came back through the all-to-all's backward), so it is only divided by N.
Tested on gloo (CPU); NCCL's all_to_all_single takes the same splits, but GPU runs (and HF's
grouped_mm expert kernels in bf16 there) are unverified on hardware. Introduced in notebook 09_beyond_3d.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from labkit.errors import ConfigError
from labkit.parallel.single import Strategy


def apply_expert_parallel(model: nn.Module, group, *, cfg=None) -> nn.Module:
    """Keep this rank's E/N experts of every MoE layer of an HF model and route tokens with all-to-all.

    In place. Expert modules are the ones holding stacked expert weights (`gate_up_proj`,
    `down_proj` of shape (E, ...), transformers' Mixtral layout); their parameters are marked
    `labkit_expert = True` for the gradient rule above.
    """
    if group is None:
        raise ConfigError("expert-parallel needs a process group: launch with --nproc N (torchrun)")
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    layers = [m for m in model.modules() if _is_experts(m)]
    if not layers:
        raise ConfigError("expert-parallel found no mixture-of-experts layer in the model; use --model tiny-moe")
    for experts in layers:
        if experts.num_experts % n:
            raise ConfigError(f"{experts.num_experts} experts do not split over {n} ranks; use an --nproc "
                              f"that divides {experts.num_experts}")
        local = experts.num_experts // n
        for name in ("gate_up_proj", "down_proj"):  # (E, out, in) -> this rank's (E/N, out, in)
            full = getattr(experts, name)
            shard = nn.Parameter(full.detach()[rank * local:(rank + 1) * local].clone(), requires_grad=full.requires_grad)
            shard.labkit_expert = True
            setattr(experts, name, shard)
        experts.num_experts = local
        local_forward = experts.forward  # HF's expert computation, now over the local experts
        experts.forward = functools.partial(expert_parallel_forward, local_forward=local_forward,
                                            group=group, local=local)
    model.labkit_ep = {"ep": n, "experts_per_rank": layers[0].num_experts, "moe_layers": len(layers)}
    return model


def _is_experts(module: nn.Module) -> bool:
    w = getattr(module, "gate_up_proj", None)
    return isinstance(w, nn.Parameter) and w.dim() == 3 and hasattr(module, "num_experts")


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with split sizes; its backward is the reverse all-to-all (the
    gradient of a received row goes back to the rank that sent it)."""

    @staticmethod
    def forward(ctx, x, send_splits: list, recv_splits: list, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), recv_splits, send_splits, ctx.group), None, None, None


def expert_parallel_forward(hidden, top_k_index, top_k_weights, *, local_forward, group, local: int):
    """Dispatch -> local experts -> combine. hidden (N,H); top_k_index, top_k_weights (N,k)."""
    n_tokens, k = top_k_index.shape
    expert = top_k_index.reshape(-1)  # (N*k,) expert of each routing slot
    order = torch.argsort(expert, stable=True)  # slots grouped by expert, hence by owner rank
    token = torch.arange(n_tokens, device=hidden.device).repeat_interleave(k)[order]  # (N*k,)
    owner = expert[order] // local
    send = torch.bincount(owner, minlength=dist.get_world_size(group))  # slots per destination
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # how many slots each rank sends me
    send_s, recv_s = send.tolist(), recv.tolist()

    local_ids = (expert[order] - owner * local).unsqueeze(1)  # (N*k, 1) id among the owner's experts
    ids = torch.empty(sum(recv_s), 1, dtype=local_ids.dtype, device=hidden.device)
    dist.all_to_all_single(ids, local_ids, recv_s, send_s, group=group)
    x = _AllToAll.apply(hidden[token], send_s, recv_s, group)  # dispatch: (M,H) tokens for my experts
    y = local_forward(x, ids, torch.ones_like(ids, dtype=hidden.dtype))  # (M,H) each token's expert output
    back = _AllToAll.apply(y, recv_s, send_s, group)  # combine: (N*k,H) results, home again
    weights = top_k_weights.reshape(-1)[order].unsqueeze(1).to(back.dtype)  # (N*k,1) router scores
    return torch.zeros_like(hidden).index_add(0, token, back * weights)  # combine: sum of k slots


def average_gradients(model: nn.Module, group) -> None:
    """Dense gradients: mean over ranks. Expert gradients: divided by N (they already sum all ranks)."""
    n = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is None:
            continue
        if not getattr(p, "labkit_expert", False):
            dist.all_reduce(p.grad, group=group)
        p.grad.div_(n)


def expert_bytes(model: nn.Module) -> int:
    """Bytes of the expert parameters this rank holds."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if getattr(p, "labkit_expert", False))


# ------------------------------------------------------------------------------------------ hook
class ExpertParallelStrategy(Strategy):
    """Hook for 'expert-parallel': data parallel everywhere except the experts, which are split."""

    example_model = "tiny-moe"  # a dense LLM has no experts to place

    @classmethod
    def check(cls, cfg, world_size: int) -> None:
        from labkit.zoo.models import llm_config

        experts = getattr(llm_config(cfg.run.model), "num_local_experts", 0) if cfg.kind == "llm" else 0
        if not experts:
            raise ConfigError(f"expert-parallel splits the experts of a mixture-of-experts model; {cfg.run.model!r} "
                              "has none: use --model tiny-moe")
        if experts % world_size:
            raise ConfigError(f"{experts} experts do not split over {world_size} ranks; use an --nproc that "
                              f"divides {experts}")
        if cfg.precision.compile:
            raise ConfigError("expert-parallel's token routing has data-dependent shapes; run it without --compile")
        super().check(cfg, world_size)

    def wrap(self, model: nn.Module) -> nn.Module:
        return apply_expert_parallel(model, self.ctx.group, cfg=self.cfg)

    def optimizer_step(self) -> None:
        average_gradients(self.model, self.ctx.group)
        super().optimizer_step()

    def flops_per_step(self, global_tokens: int) -> float | None:
        return None  # 6 N D would count every expert per token: let the loop measure

    # Checkpoints: the expert shards are plain tensors, which DCP would take for replicas. Hand them
    # to DCP as DTensors sharded on dim 0 (global shape (E, ...)), so any world size -- 'single'
    # included -- can load the checkpoint (DCP reshards), and turn them back into local tensors on load.
    def state_dict(self) -> dict:
        from torch.distributed.tensor import DTensor, Shard

        mesh = self.dims.build_mesh(self.ctx.device, ("ep",))  # 1-D: ep = world
        shard = lambda t: DTensor.from_local(t, mesh, [Shard(0)], run_check=False)  # noqa: E731
        return self._map_experts(super().state_dict(), shard)

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(self._map_experts(state, lambda t: t.to_local()))

    def _map_experts(self, state: dict, fn) -> dict:
        names = {n for n, p in self._unwrapped().named_parameters() if getattr(p, "labkit_expert", False)}
        for name in names:
            state["model"][name] = fn(state["model"][name])
            slots = state["optim"].get("state", {})
            if name in slots:  # a new dict: the old one may be the optimizer's own state
                slots[name] = {k: fn(v) if torch.is_tensor(v) and v.dim() > 0 else v  # exp_avg(_sq), not step
                               for k, v in slots[name].items()}
        return state

    def record_facts(self) -> dict:
        from labkit.facts import ExpertFacts
        ep = self.model.labkit_ep
        mine = expert_bytes(self.model)
        return {**super().record_facts(), "expert": ExpertFacts(
            ep=ep["ep"], experts_per_rank=ep["experts_per_rank"], moe_layers=ep["moe_layers"],
            expert_param_bytes=mine, expert_param_bytes_all_ranks=mine * ep["ep"])}


STRATEGY_CLASSES = {"expert-parallel": ExpertParallelStrategy}
