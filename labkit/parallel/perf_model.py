"""Step time, MFU and HFU of one transformer layout on N GPUs: the planner's time model.

Pure Python, no torch. Per optimizer step, on the slowest pipeline stage (the last one: it also runs
the LM head), one micro-batch costs
  matmul      (3 + recompute) x forward GEMM FLOPs / (peak x achievable matmul efficiency); the linears at
              the FP8 peak when `precision="fp8"`; a causal fused (flash) attention computes half its s^2
              scores (it skips the masked blocks), the 2021-22 softmax kernels all of them
  non-matmul  bytes / (HBM bandwidth x MEMORY_EFFICIENCY): norms, softmax, GeLU, dropout, residuals are
              memory bound; each saved activation (`labkit.memory.activations`) is written once and read
              once in the forward, twice that in the backward, once more when recomputed
  TP          all-reduces on NVLink, 2 forward + 2 backward per layer (+ 2 when the whole layer is
              recomputed), NOT overlapped (Narayanan et al. 2021 Sec. 3.2: on the critical path)
  PP          one send forward, one backward of b*s*h/t bytes (scatter-gather, Sec. 4.1), over the
              inter-node link once the pipeline leaves the node
and the step is (m + (p - 1) / v) micro-batch slots (1F1B; interleaved with v chunks per GPU). Data-parallel
traffic is modelled layer by layer (`labkit.parallel.perf_dp`: DDP, ZeRO-1/2/3, FSDP, HSDP) and only the part
the neighbouring layers' compute cannot hide is added. Then the optimizer step (memory bound, ~32 B per
parameter it updates).

FLOPs are counted as the papers count them (Narayanan et al. 2021 Eq. 3; Korthikanti et al. 2022
Sec. 6): every GEMM of the forward (2 x fan_in x fan_out per token and linear, 4 s h per token for
QK^T and AV, no causal halving, 2 h V for the logits), x3 for forward + backward. MFU counts only
those, against the bf16 peak (also for FP8 runs, as Llama 3 and torchtitan report it); HFU adds the
recomputed forward (full: every layer; selective: the attention core).

GPUs, fabrics and the fitted constants: `labkit.parallel.hardware`. Validated against
`labkit/data/published_runs.json` (`labkit.parallel.published_runs`, `bench/planner_heldout.py`).
Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.errors import ConfigError
from labkit.parallel import comm
from labkit.parallel.hardware import (ALIASES, GPUS, MEMORY_EFFICIENCY, OPTIMIZER_BYTES, PERF_FILE_ENV,  # noqa: F401
                                      PERF_FILE_NAME, Efficiency, GpuSpec, comm_efficiency, default_efficiency,
                                      gpu_family, gpu_spec, matmul_efficiency, read_perf_file,
                                      record_measurement)
from labkit.parallel.perf_dp import dp_time


@dataclass(frozen=True)
class Layout:
    """How one step is split: parallel degrees, micro-batching, recomputation, kernels, sharding."""

    dp: int
    tp: int
    pp: int
    micro_batch: int
    microbatches: int
    """Micro-batches per pipeline (data-parallel replica) per optimizer step."""
    checkpointing: str = "full"
    zero: int = 0
    sequence_parallel: bool = True
    """Korthikanti et al. 2022: norms and dropout split over the TP ranks (only matters when tp > 1)."""
    interleave: int = 1
    """Model chunks per GPU (Narayanan et al. 2021 Sec. 2.2.2): the bubble shrinks by this factor."""
    flash: bool = True
    """Fused attention (no s x s scores in HBM); False = the 2021-22 Megatron softmax kernels."""
    cp: int = 1
    """Context parallel: GPUs one sequence is split over (ring attention); they also reduce gradients."""
    ep: int = 1
    """Expert parallel (MoE): dp ranks the experts are split over; tokens move by all-to-all."""
    fsdp: bool = False
    """zero=3 as torch FSDP: a fully recomputed forward reuses the backward's gathered parameters
    (DeepSpeed ZeRO-3 gathers them once more)."""
    shard_group: int = 0
    """HSDP: ZeRO shards over groups of this many dp ranks and replicates across them; 0 = all dp ranks."""
    dp_overlap: bool = True
    """The gradient reduce / parameter gather overlap the backward / forward (False: Megatron-LM 2021-22)."""
    precision: str = "bf16"
    """bf16 (V100: fp16) or fp8 (the linears on FP8 tensor cores)."""
    fused_kernels: bool = True
    """Activations saved as fused kernels save them (Megatron, Meta); False = Hugging Face's eager modules."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batch", "microbatches", "interleave", "cp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}; it must be a positive integer")
        if self.interleave > 1 and self.pp == 1:
            raise ConfigError(f"interleave={self.interleave} needs pipeline parallelism (pp > 1): it splits each "
                              "pipeline rank's layers into chunks; use interleave 1")
        if self.shard_group and (not self.zero or self.dp % self.shard_group):
            raise ConfigError(f"shard_group={self.shard_group} must divide dp={self.dp} and needs zero >= 1 (HSDP)")


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step by component, and the utilizations they imply."""

    matmul_s: float
    nonmatmul_s: float
    tp_s: float
    pp_s: float
    dp_s: float
    """Data-parallel communication NOT hidden under the compute."""
    optimizer_s: float
    bubble: float
    step_s: float
    model_flops: float
    hardware_flops: float
    mfu: float
    hfu: float
    tflops_per_gpu: float
    """Hardware TFLOPS achieved per GPU (recomputation included, as Narayanan et al. report it)."""
    comm_bytes: dict
    """Bytes each GPU sends per step by dimension: tp, pp, dp (cp, ep when > 1)."""
    cp_s: float = 0.0
    """Ring-attention K/V exchange, counted as exposed (a fused ring kernel hides part of it)."""
    ep_s: float = 0.0
    """Expert all-to-all (dispatch + combine, forward and backward), counted as exposed."""
    tokens_per_s_per_gpu: float = 0.0
    dp_total_s: float = 0.0
    """All data-parallel communication time, hidden or not."""


def attention_flops(spec, seq: int) -> float:
    """Forward FLOPs per token of QK^T and AV (no causal halving, as the papers count)."""
    return 4 * seq * spec.arch["heads"] * spec.arch["head_dim"]


def linear_flops(spec) -> float:
    """Forward FLOPs per token of the layer's linears (MoE: the k experts a token visits + the router)."""
    gemms = 2 * sum(lin.fan_in * lin.fan_out for lin in spec.linears)
    if spec.arch.get("experts"):  # each token runs k SwiGLU experts (3 h x inter GEMMs) + the router
        a = spec.arch
        gemms += 2 * (a["top_k"] * 3 * a["hidden"] * a["intermediate"] + a["experts"] * a["hidden"])
    return gemms


def layer_forward_flops(spec, seq: int) -> float:
    """Forward FLOPs of one layer per token: the GEMMs (from the spec's linears) + QK^T and AV."""
    return linear_flops(spec) + attention_flops(spec, seq)


def recompute_flops(spec, seq: int, checkpointing: str, flash: bool = False) -> float:
    """Forward FLOPs per token and layer that the backward redoes. Selective: the attention core
    (Korthikanti Sec. 5) with the eager softmax; with flash attention its output is kept and only
    elementwise work is redone (no matmul FLOPs)."""
    if checkpointing == "full":
        return layer_forward_flops(spec, seq)
    if checkpointing == "selective" and not flash:
        return attention_flops(spec, seq)
    return 0.0


def step_flops(spec, tokens: int, seq: int, checkpointing: str, flash: bool = False) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step of `tokens` tokens."""
    layers, logits = spec.arch["layers"], 2 * spec.arch["hidden"] * spec.arch["vocab"]
    model = 3 * tokens * (layers * layer_forward_flops(spec, seq) + logits)
    return model, model + tokens * layers * recompute_flops(spec, seq, checkpointing, flash)


def _nonmatmul_bytes(spec, lay: Layout, seq: int) -> float:
    """HBM bytes per layer and micro-batch moved by elementwise kernels (forward, backward, recompute)."""
    from labkit.memory import activations as act

    st = act.Step(micro_batch=lay.micro_batch, seq=seq, act_bytes=2, flash=lay.flash, tp=lay.tp,
                  sp=lay.sequence_parallel and lay.tp > 1, fused=lay.fused_kernels)
    layer = (act.gpt_layer if spec.kind == "gpt" else act.llama_layer)(spec.arch, st)
    saved = layer.stored(st)
    redo = {"full": saved, "selective": layer.core / lay.tp, "none": 0.0}[lay.checkpointing]
    return 2 * saved + 4 * saved + 2 * redo  # written+read forward, twice in backward, recompute


def _rates(gpu: str, lay: Layout, efficiency: Efficiency) -> tuple[float, float]:
    """(FLOP/s of the linears, FLOP/s of attention and the LM head)."""
    g = gpu_spec(gpu)
    if lay.precision == "fp8":
        if not g.fp8_tflops:
            raise ConfigError(f"precision fp8 on {gpu}: it has no FP8 tensor cores; use bf16")
        bf16 = default_efficiency(gpu, "bf16").value
        return g.fp8_tflops * 1e12 * efficiency.value, g.peak_tflops * 1e12 * bf16
    rate = g.peak_tflops * 1e12 * efficiency.value
    return rate, rate


def step_time(spec, lay: Layout, *, seq: int, gpu: str, gpus_per_node: int, efficiency: Efficiency,
              params_on_gpu: float | None = None, inter_node_gbps: float | None = None) -> StepTime:
    """The time model of the module docstring for `spec` (a `labkit.memory.params.ModelSpec`)."""
    g = gpu_spec(gpu)
    inter = inter_node_gbps or g.inter_node_gbps
    gpus = lay.dp * lay.tp * lay.pp * lay.cp
    a, b, t = spec.arch, lay.micro_batch, lay.tp
    layers = math.ceil(a["layers"] / lay.pp)
    lin_rate, attn_rate = _rates(gpu, lay, efficiency)
    tok = b * seq // lay.cp  # this GPU's tokens of a micro-batch (its queries still see all seq keys)
    redo_share = {"full": 1.0, "selective": 0.0, "none": 0.0}[lay.checkpointing]
    lin = layers * tok * linear_flops(spec) / t / lin_rate
    attn = layers * tok * attention_flops(spec, seq) / t / attn_rate * (0.5 if lay.flash else 1.0)
    head = tok * 2 * a["hidden"] * a["vocab"] / t / attn_rate  # vocab-parallel LM head, on the last stage
    redo_attn = attn if lay.checkpointing == "full" or (lay.checkpointing == "selective" and not lay.flash) else 0.0
    fwd_mm = lin + attn + head
    matmul = 3 * fwd_mm + redo_share * lin + redo_attn
    nonmatmul = layers * _nonmatmul_bytes(spec, lay, seq // lay.cp) / (g.hbm_gbs * 1e9 * MEMORY_EFFICIENCY)
    act = tok * a["hidden"] * 2  # one (b, s, h) bf16 activation
    n_ar = (6 if lay.checkpointing == "full" else 4) * layers
    tp_bytes = n_ar * comm.bytes_sent("all_reduce", act, t)
    nvlink = g.nvlink_gbs * 1e9 * comm_efficiency("nvlink")
    tp = tp_bytes / nvlink
    pp_bytes = 2 * comm.bytes_sent("send_recv", act / t, 2) if lay.pp > 1 else 0.0  # forward + backward
    crosses = gpus > gpus_per_node and t * lay.cp * lay.dp >= gpus_per_node  # stages tp*cp*dp ranks apart
    network = inter / 8 * 1e9 * comm_efficiency("network")
    pp = pp_bytes / (network if crosses else nvlink)
    cp_bytes, ep_bytes = _cp_ep_bytes(spec, lay, tok, layers)
    cp = cp_bytes / (nvlink if t * lay.cp <= gpus_per_node else network)
    ep = ep_bytes / (nvlink if gpus <= gpus_per_node else network)
    slot = matmul + nonmatmul + tp + pp + cp + ep
    m = lay.microbatches
    pipeline = comm.step_slots(lay.pp, m, lay.interleave) * slot
    bubble = comm.bubble_fraction(lay.pp, m, lay.interleave)
    params = params_on_gpu if params_on_gpu is not None else spec.params / (t * lay.pp)
    fwd_s = slot * fwd_mm / (3 * fwd_mm + redo_share * lin + redo_attn)
    dp = dp_time(lay, gpu=g, layers=layers, params_on_gpu=params, fwd_s=fwd_s, bwd_s=slot - fwd_s,
                 gpus_per_node=gpus_per_node, inter_node_gbps=inter)
    d = lay.dp * lay.cp
    updated = params / (d if lay.zero else 1)
    optimizer = OPTIMIZER_BYTES * updated / (g.hbm_gbs * 1e9 * MEMORY_EFFICIENCY)
    step = pipeline + dp.exposed + optimizer
    tokens = b * m * lay.dp * seq
    model, hardware = step_flops(spec, tokens, seq, lay.checkpointing, lay.flash)
    peak_all = gpus * g.peak_tflops * 1e12
    return StepTime(matmul_s=m * matmul, nonmatmul_s=m * nonmatmul, tp_s=m * tp, pp_s=m * pp, dp_s=dp.exposed,
                    optimizer_s=optimizer, bubble=bubble, step_s=step, model_flops=model,
                    hardware_flops=hardware, mfu=model / (peak_all * step), hfu=hardware / (peak_all * step),
                    tflops_per_gpu=hardware / gpus / step / 1e12,
                    comm_bytes={"tp": int(m * tp_bytes), "pp": int(m * pp_bytes), "dp": int(dp.bytes),
                                **({"cp": int(m * cp_bytes)} if lay.cp > 1 else {}),
                                **({"ep": int(m * ep_bytes)} if lay.ep > 1 else {})},
                    cp_s=m * cp, ep_s=m * ep, tokens_per_s_per_gpu=tokens / step / gpus, dp_total_s=dp.seconds)


def _cp_ep_bytes(spec, lay: Layout, tok: int, layers: int) -> tuple[float, float]:
    """Bytes one GPU sends per micro-batch for context and expert parallelism (bf16).

    Ring attention (Liu et al. 2023): cp - 1 K/V blocks of tok x kv_heads x head_dim forward; the
    backward passes K/V and their gradients around again (x3 in all). Expert all-to-all (GShard):
    tok x k token copies of width h leave the GPU ((ep-1)/ep of them) for dispatch and come back for
    combine, forward and backward (x4)."""
    a = spec.arch
    cp = 3 * layers * comm.hops("all_gather", lay.cp) * 2 * tok * a["kv_heads"] * a["head_dim"] * 2 / lay.tp \
        if lay.cp > 1 else 0.0
    copies = tok * a.get("top_k", 0) * a["hidden"] * 2  # bytes of this GPU's routed token copies
    ep = 4 * layers * comm.bytes_sent("all_to_all", copies, lay.ep) if lay.ep > 1 else 0.0
    return cp, ep


@dataclass(frozen=True)
class Budget:
    """What training `tokens` tokens costs with one layout (notebook 09's budget)."""

    tokens: float
    gpus: int
    steps: int
    step_s: float
    days: float
    gpu_hours: float
    cost: float
    mfu: float
    hfu: float
    tflops_per_gpu: float
    efficiency: Efficiency


def budget(model, tokens: float, layout: Layout, gpus: int, price_per_gpu_hour: float = 0.0, *, seq: int = 2048,
           gpu: str = "a100-80gb", gpus_per_node: int = 8, efficiency: Efficiency | None = None,
           inter_node_gbps: float | None = None) -> Budget:
    """Days, GPU-hours and cost of `tokens` training tokens for `model` (a preset name or a
    `labkit.memory.params.ModelSpec`) with `layout` on `gpus` GPUs, from `step_time`.

    Narayanan et al. 2021 Eq. 4 estimate the same with 8 T P / (n X) at an assumed X TFLOPS per GPU."""
    from labkit.memory.estimate import check_topology
    from labkit.memory.params import model_spec

    check_topology(layout.dp, layout.tp, layout.pp, gpus, layout.cp)
    if tokens <= 0 or price_per_gpu_hour < 0:
        raise ConfigError(f"tokens={tokens!r}, price_per_gpu_hour={price_per_gpu_hour!r}: tokens must be "
                          "positive and the price not negative")
    spec = model_spec(model) if isinstance(model, str) else model
    eff = efficiency or matmul_efficiency(gpu, layout.precision if layout.precision == "fp8" else
                                          ("fp16" if gpu_family(gpu) == "v100" else "bf16"))
    t = step_time(spec, layout, seq=seq, gpu=gpu, gpus_per_node=gpus_per_node, efficiency=eff,
                  inter_node_gbps=inter_node_gbps)
    per_step = layout.dp * layout.microbatches * layout.micro_batch * seq
    steps = math.ceil(tokens / per_step)
    seconds = steps * t.step_s
    hours = seconds / 3600 * gpus
    return Budget(tokens=tokens, gpus=gpus, steps=steps, step_s=t.step_s, days=seconds / 86400, gpu_hours=hours,
                  cost=hours * price_per_gpu_hour, mfu=t.mfu, hfu=t.hfu, tflops_per_gpu=t.tflops_per_gpu,
                  efficiency=eff)
