"""Train the profile's LLM the way `labkit.train.run` does, with a student's hand-made parallel code inside.

The compare cells of notebooks 04 and 05 run a student's FSDP wrapping or ZeRO-1 step beside labkit's
strategy, loss for loss. That only means something if everything else is the same: the preset's
initial weights (its seed), the same global batches (each rank its DistributedSampler share, as
`labkit.train.data.StepLoader` hands them out), the same AdamW and learning rate, the loss averaged
over the ranks: `replay.library_parts` builds them, `train_llm` is the loop, short enough to read whole.
`state_bytes` is what notebook 04's ZeRO-1 tests and compare cell measure a rank's state with.
Introduced in notebook 04_fsdp.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn


def train_llm(rank: int, world: int, strategy: str, model: str, *,
              parallelize: Callable[[nn.Module], nn.Module] | None = None,
              step: Callable[[list], None] | None = None, **options) -> dict:
    """Train as `run(strategy, model, nproc=world, **options)` does, on this rank (call on every rank).

    `parallelize(model)` shards or wraps the single-device model (e.g. the student's `shard_model`);
    `step(params)` replaces AdamW's step (e.g. the student's ZeRO-1 step, which also averages the
    gradients). Without `step` the parallelized model must average the gradients itself (FSDP, DDP).
    Returns {"losses": the global mean loss per step (the record's `losses`), "params": trainable numel}.
    """
    from labkit.course.exercises.replay import library_parts
    from labkit.optim import build_optimizer

    parts = library_parts(strategy, model, dp_rank=rank, dp_size=world, nproc=world, **options)
    net = parallelize(parts.model) if parallelize is not None else parts.model
    params = [p for p in net.parameters() if p.requires_grad]
    # fully_shard replaces the parameters by DTensors: the optimizer is built on what the model now holds
    optimizer = None if step is not None else build_optimizer(parts.cfg.optim.optimizer or "adamw", params, parts.cfg.optim.lr)
    losses = []
    for _ in range(parts.cfg.run.steps):
        inputs, targets = next(parts.batches)
        loss = parts.task.loss(net, inputs, targets)  # mean over this rank's tokens, fp32
        loss.backward()
        if step is not None:
            step(params)
        else:
            optimizer.step()
        for p in params:
            p.grad = None
        losses.append(loss.detach())
    mean = torch.stack(losses)
    dist.all_reduce(mean)  # the record's losses: every rank's local mean, averaged
    return {"losses": (mean / world).tolist(), "params": sum(p.numel() for p in params)}


def mesh(profile: str, world: int):
    """The 1-D DeviceMesh over the `world` ranks of a `spawn(..., profile=...)` job, of this rank's device
    type (cuda on a GPU node, cpu in smoke): what a hand-written FSDP shards over, on the device
    `library_parts` put the model on (`labkit.runtime.device.mesh`)."""
    from labkit.runtime import device as devices
    from labkit.profiles import get_profile

    return devices.mesh(devices.for_rank(get_profile(profile), dist.get_rank()), (world,))


def state_bytes(obj, seen: set | None = None) -> int:
    """Bytes of every tensor reachable from `obj` (tensors, optimizers with their states and params,
    dicts, lists), each storage counted once: what a ZeRO-1 state dict costs a rank."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, torch.optim.Optimizer):
        return state_bytes([list(s.values()) for s in obj.state.values()], seen) + \
            state_bytes([g["params"] for g in obj.param_groups], seen)
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(item, seen) for item in obj)
    return 0
