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
None of the three includes activations. `state_layouts` shows where the 16 B sit in each stack (the
ZeRO paper's 2 + 2 + 12 is DeepSpeed's and Megatron's layout; torch.autocast keeps 4 + 4 + 8; Megatron
with fp32 gradients 18), `kbit_upcast_bytes` what PEFT's k-bit preparation adds to a QLoRA base and
`offload_host_bytes` an offloaded run's host RAM per rank and per node. Introduced in notebook 01_memory.
"""
from __future__ import annotations

from typing import NamedTuple

from labkit.errors import ConfigError


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


class Layout(NamedTuple):
    name: str
    weights: float
    grads: float
    optimizer: float
    where: str

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def state_layouts(dp: int = 1) -> list[Layout]:
    """Bytes per trained parameter of mixed-precision AdamW as each stack lays it out (dp ranks for the
    distributed optimizer). "16 B" is right for the first two, for different reasons: read the parts."""
    if dp < 1:
        raise ConfigError(f"dp={dp!r}; the data-parallel size is a whole number >= 1")
    return [
        Layout("DeepSpeed / Megatron bf16 (ZeRO paper)", 2, 2, 12, "bf16 weights and grads, fp32 master + m + v "
               "(Rajbhandari et al. 2020 Sec. 3.1)"),
        Layout("torch.autocast (labs 02, 03)", 4, 4, 8, "fp32 weights and grads, fp32 m + v; autocast casts "
               "copies per op, so there is no master copy to add and nothing to halve"),
        Layout("Megatron bf16, fp32 main grads", 2, 4, 12, "18 B: grads accumulate in fp32 "
               "(Megatron-LM docs/source/distrib_optimizer.md)"),
        Layout(f"  + distributed optimizer, d={dp}", 2, 4, 12 / dp, "6 + 12/d B: master + m + v sharded over d"),
    ]


def format_layouts(rows: list[Layout]) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'layout':<{width}}  weights  grads  optimizer  B/param"]
    lines += [f"{r.name:<{width}}  {r.weights:7g}  {r.grads:5g}  {r.optimizer:9.3g}  {r.total:7.3g}" for r in rows]
    return "\n".join(lines)


def kbit_upcast_bytes(model: str) -> int:
    """Bytes PEFT's `prepare_model_for_kbit_training` adds to a 4-bit model: it casts every 16-bit parameter
    that is not 4-bit (embedding, LM head, norms) to fp32, +2 B each (peft/utils/other.py). labkit's
    `apply_qlora` casts the embedding and head back to the compute dtype, as the QLoRA reference script
    does, and its estimate assumes that; norms are a few hundred thousand parameters."""
    from labkit.memory.params import model_spec

    spec = model_spec(model)
    quantized = sum(lin.fan_in * lin.fan_out * lin.count for lin in spec.linears)
    return 2 * (spec.params - quantized)


def offload_host_bytes(cfg, ranks_per_node: int) -> tuple[int, int]:
    """(per rank, per node) host bytes of an offloaded `MemoryConfig`: every rank of the node offloads its
    own shard (optimizer states, their fp32 gradient copy, and with params the weights)."""
    from labkit.memory.estimate import estimate

    per_rank = estimate(cfg).cpu_bytes
    return per_rank, per_rank * ranks_per_node
