"""Three published rules for "how much memory does an Adam fine-tune need", side by side.

They disagree on the same model because they count different things:

- accelerate's `estimate-memory` ("Training using Adam" column; accelerate/commands/estimate.py,
  `estimate_training_usage`): fp32 training = model + grads + 2 Adam states, each the fp32 model size, and
  the column prints the *largest* of these parts (4x the fp32 weights for fp32 = 16 B/param). For float16 it
  prints 8 B/param: the optimizer part alone, as if the weights and gradients were freed by then.
- DeepSpeed's estimators (`estimate_zero2_model_states_mem_needs`, no offload, one GPU): 2 B bf16 weights
  + 18 B = 2 bf16 grads + 4 fp32 grads + 4 fp32 master + 8 Adam moments = 20 B/param (it keeps an fp32
  copy of the gradients); ZeRO-3 adds 4 B per parameter of the largest layer.
- The ZeRO paper (Rajbhandari et al. 2020, Sec. 3.1): 2 B weights + 2 B grads + K = 12 B optimizer
  (master, momentum, variance) = 16 B/param, the sum that `labkit.memory.estimate` uses.
None of the three includes activations. Introduced in notebook 01_memory.
"""
from __future__ import annotations

from typing import NamedTuple


class Convention(NamedTuple):
    name: str
    bytes: int
    counts: str


def conventions(params: int, largest_layer: int) -> list[Convention]:
    """Model-state bytes on one GPU for a mixed-precision (bf16) Adam fine-tune, by each rule."""
    return [
        Convention("accelerate estimate-memory, float32", 4 * params * 4,
                   "largest part: fp32 model, grads, 2 Adam states, each 4 B/param -> step = 16 B/param"),
        Convention("accelerate estimate-memory, float16", 2 * 4 * params,
                   "largest part only: the 2 fp32 Adam states = 8 B/param"),
        Convention("DeepSpeed ZeRO-2 estimator, 1 GPU", 2 * params + 18 * params,
                   "2 bf16 weights + 2 bf16 grads + 4 fp32 grads + 4 fp32 master + 8 moments = 20 B/param"),
        Convention("DeepSpeed ZeRO-3 estimator, 1 GPU", 4 * largest_layer + 18 * params,
                   "18 B/param + 4 B per parameter of the largest layer (gathered)"),
        Convention("ZeRO paper (2 + 2 + 12)", 16 * params,
                   "sum of bf16 weights + bf16 grads + fp32 master, momentum, variance = 16 B/param"),
    ]


def format_conventions(rows: list[Convention], params: int) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'rule':<{width}}  {'GB':>7}  {'B/param':>7}  what it counts"]
    lines += [f"{r.name:<{width}}  {r.bytes / 1e9:7.1f}  {r.bytes / params:7.1f}  {r.counts}" for r in rows]
    return "\n".join(lines)
