"""Distributed data parallel: a full replica per rank, gradients averaged with all-reduce.

Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training": DDP groups
gradients into ~25 MiB buckets and starts each bucket's all-reduce as soon as backward has produced
it, overlapping communication with the rest of backward. A ring all-reduce (Patarasuk & Yuan 2009)
moves 2 (N-1)/N x S bytes per rank for S bytes of gradients, nearly independent of N.
Introduced in notebook 03_ddp.
"""
from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from labkit.runtime import device as devices
from labkit.errors import ConfigError
from labkit.parallel import comm
from labkit.parallel.single import Strategy


def apply_ddp(model: nn.Module, group, *, cfg=None) -> nn.Module:
    """Wrap `model` (already on this rank's device) in DDP over process group `group`.

    DDP broadcasts rank 0's parameters and buffers at construction, so every replica starts equal;
    its backward hooks then average gradients (sum / world size), which makes the update equal to the
    single-process update on the whole global batch.
    """
    if group is None:
        raise ConfigError("ddp needs a process group: launch with --nproc N (torchrun), not in-process")
    device = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=devices.ddp_device_ids(device), process_group=group)


def allreduce_seconds(grad_bytes: float, world_size: int, bandwidth_bytes_s: float, *,
                      bucket_bytes: float = 25 * 2**20, latency_s: float = 0.0) -> dict:
    """Ring all-reduce cost model for one step's gradients (Patarasuk & Yuan 2009).

    Each rank sends (and receives) 2 (N-1)/N x S bytes: N-1 reduce-scatter hops plus N-1 all-gather
    hops of S/N bytes each. DDP splits S into ~25 MiB buckets; each bucket pays the hops' latency
    2 (N-1) x latency_s, and all but the last can overlap with the rest of backward.
    """
    n = world_size
    buckets = max(1, -(-int(grad_bytes) // int(bucket_bytes)))  # ceil
    sent = comm.bytes_sent("all_reduce", grad_bytes, n)
    seconds = comm.seconds("all_reduce", grad_bytes, n, bandwidth_bytes_s, latency_s=latency_s, messages=buckets)
    last_bucket = seconds * min(1.0, bucket_bytes / grad_bytes) if grad_bytes else 0.0
    return {"bytes_sent_per_rank": sent, "buckets": buckets, "seconds": seconds,
            "exposed_seconds_if_overlapped": last_bucket}


class DDPStrategy(Strategy):
    """DDP hook: wrap with `apply_ddp`, skip the all-reduce on all but the last micro-batch."""

    def wrap(self, model: nn.Module) -> nn.Module:
        return devices.stand_in_ddp(apply_ddp(model, self.ctx.group, cfg=self.cfg))

    def no_sync(self):
        # Gradient accumulation: without no_sync every micro-batch would all-reduce its gradients;
        # inside it DDP only accumulates locally, and the last micro-batch's backward reduces the sum.
        return self.model.no_sync()

    def record_facts(self) -> dict:
        from labkit.facts import CommFacts
        # Gradient bytes each step's all-reduce moves per rank (ring): 2 (N-1)/N x S.
        n = self.ctx.world_size
        grad_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        return {**super().record_facts(), "comm": CommFacts(all_reduce=int(comm.bytes_sent("all_reduce", grad_bytes, n)),
                                                            bucket_cap_mb=25)}


STRATEGY_CLASSES = {"ddp": DDPStrategy}
