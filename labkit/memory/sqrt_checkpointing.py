"""The sqrt(n) rule of activation checkpointing, measured (Chen et al. 2016, "Training Deep Nets with
Sublinear Memory Cost", arXiv:1604.06174, section 4).

Cut a chain of n equal layers into k segments and keep only each segment's input during forward;
backward recomputes one segment at a time. Peak activation memory is then about
    k x (one boundary)  +  (n / k) x (one layer's activations)
(the boundaries kept, plus the segment being recomputed), which is smallest at k = sqrt(n): memory
O(sqrt n) for one extra forward pass. `measure_segments` runs the real thing
(`torch.utils.checkpoint.checkpoint_sequential`) on a chain of Linear+GELU layers and counts the bytes
of every tensor alive at once during forward + backward. Introduced in notebook 02_single_gpu.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint_sequential


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the mode and still alive (activations, grads).

    Counts every op's outputs once per storage and frees them when the storage is garbage: on CPU
    this is what `torch.cuda.max_memory_allocated` measures on a GPU (minus allocator rounding)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self._live:
                    self._live[key] = nbytes
                    self.current += nbytes
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out


def saved_bytes(fn, *args, **kwargs):
    """(fn(*args, **kwargs), bytes of the tensors autograd saved for backward during the call).

    Counts each storage once through `torch.autograd.graph.saved_tensors_hooks`: what a forward keeps
    alive until backward. Non-reentrant checkpointing keeps its own (inner) hooks, so a checkpointed
    block shows only its input here. Used by notebook 02_single_gpu's checkpointing exercise."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return out, sum(seen.values())


@dataclass(frozen=True)
class SegmentPeak:
    segments: int
    """k: checkpointed segments (0 = no checkpointing, every activation kept)."""
    peak_bytes: int
    """Peak bytes alive during one forward + backward: activations and the gradients flowing back."""


def chain(n_layers: int, width: int, seed: int = 0) -> nn.Sequential:
    """n equal Linear(width, width) + GELU layers: the 'chain' of the sqrt(n) argument."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n_layers)])
    # Frozen weights: backward still runs through every layer (the input needs its gradient), but no
    # weight gradient builds up during backward and blurs the activations' peak.
    return model.requires_grad_(False)


def measure_segments(n_layers: int = 64, *, width: int = 256, batch: int = 512,
                     segments: tuple[int, ...] | None = None) -> list[SegmentPeak]:
    """Peak live bytes of one step of `chain(n_layers)` for each segment count (0 = no checkpointing).

    Default segment counts: none, 2, sqrt(n) rounded, n/2 and n (one layer per segment)."""
    if segments is None:
        root = round(math.sqrt(n_layers))
        segments = tuple(sorted({0, 2, root, max(2, n_layers // 2), n_layers}))
    model, rows = chain(n_layers, width), []
    for k in segments:
        if not 0 <= k <= n_layers:
            raise ValueError(f"segments={k}: use 0 (no checkpointing) to n_layers={n_layers}")
        x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with LiveBytes() as live:
            y = model(x) if k == 0 else checkpoint_sequential(model, k, x, use_reentrant=False)
            y.sum().backward()
            del y
        rows.append(SegmentPeak(k, live.peak))
    return rows
