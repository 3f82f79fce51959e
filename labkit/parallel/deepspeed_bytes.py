"""Where DeepSpeed keeps a rank's bytes: parameter partitions, gradient buffers, fp32 master partitions
and optimizer states, each storage counted once (`ZeroStrategy.resident_bytes` reports them).

DeepSpeed keeps its flat partitions in attributes of the engine's optimizer (names differ between
stages 1-2, `stage_1_and_2.py`, and stage 3, `stage3.py`; read from DeepSpeed 0.19). Introduced in
notebook 05_zero.
"""
from __future__ import annotations

import torch
from torch import nn


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor inside nested lists / tuples / dicts (DeepSpeed keeps its partitions in those)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


def ds_param_tensors(module: nn.Module) -> list[torch.Tensor]:
    """What holds parameter values: the 1/N `ds_tensor` partitions (stage 3) plus any gathered or
    persistent full tensors; at stages 1-2 the params are views of one flat buffer."""
    out = []
    for p in module.parameters():
        if hasattr(p, "ds_tensor"):
            out.append(p.ds_tensor)
        if p.data.numel():
            out.append(p.data)
    return out


def ds_grad_tensors(module: nn.Module, optimizer) -> list[torch.Tensor]:
    """Gradient storage: per-param `.grad` (full, until reduced) and DeepSpeed's partition buffers."""
    found = [p.grad for p in module.parameters() if p.grad is not None]
    for attr in ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer"):
        found += _tensors(getattr(optimizer, attr, None))
    for bucket in getattr(optimizer, "ipg_buckets", {}).values():  # reduce staging buffers
        found += _tensors(getattr(bucket, "buffer", None))
    for flat in master_partitions(optimizer):
        if flat.grad is not None:
            found.append(flat.grad)
    return found


def master_partitions(optimizer) -> list[torch.Tensor]:
    """The fp32 master partitions the inner optimizer steps (stage 1-2 / stage 3 attribute names)."""
    return _tensors(getattr(optimizer, "single_partition_of_fp32_groups", None)) + \
        _tensors(getattr(optimizer, "fp32_partitioned_groups_flat", None))


def ds_optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """fp32 master partitions + the inner optimizer's states (Adam moments) on them."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return master_partitions(optimizer) + [v for s in inner.state.values() for v in _tensors(s)]


def count_bytes(groups: list[list[torch.Tensor]], device: torch.device) -> list[tuple[int, int]]:
    """(bytes on `device`, bytes elsewhere) per group, each storage counted once, in the FIRST group
    that holds it (a buffer shared by parameters and optimizer counts as parameters)."""
    seen, out = set(), []
    for tensors in groups:
        here = away = 0
        for t in tensors:
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            if t.device.type == "meta" or key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            if t.device.type == device.type:
                here += storage.nbytes()
            else:
                away += storage.nbytes()
        out.append((here, away))
    return out
