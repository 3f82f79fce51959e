"""Step time, MFU and HFU of one transformer layout on N GPUs: the planner's time model.

Pure Python, no torch. Per optimizer step, on the slowest pipeline stage (`stage_kinds`: the last one, which also
runs the LM head and the loss, unless the partition gave it fewer transformer layers), one micro-batch costs (`labkit.parallel.perf_ops`, where each mechanism is explained)
  GEMMs       every linear's forward GEMM and the backward's two, at an additive roofline: FLOPs at the fitted
              share of the peak + operands and output through HBM (thin GEMMs -- small hidden size, small
              micro-batch, wide TP -- run slower); FP8 linears on the FP8 tensor cores
  attention   a fused (flash) kernel at its own measured efficiency (half the scores: causal), or the 2021-22
              unfused path (QK^T, AV as per-head GEMMs, the s x s scores through HBM)
  memory-bound the elementwise kernels' bytes / (HBM bandwidth x MEMORY_EFFICIENCY): fused (Megatron, TE,
              torch.compile) or eager PyTorch (`Layout.eager`), FP8 casts, the loss over the vocabulary
  recompute   full: the whole forward again; selective 'core': the attention core; 'op': every 2nd matmul
  TP          all-reduce equivalents on NVLink per layer (2 forward, 2 backward, + what recomputation redoes),
              exposed (Narayanan et al. 2021 Sec. 3.2) unless overlapped with the GEMMs beside them (AsyncTP)
  PP          1/tp of the boundary activation per rank, forward and backward per chunk (scatter/gather,
              Sec. 4.1), over the network once the pipeline leaves the node; DeepSpeed's blocking engine
              exposes twice as much
and the step is (m + (p - 1) / v) micro-batch slots (1F1B; interleaved with v chunks per GPU). Data-parallel
traffic is modelled layer by layer (`labkit.parallel.perf_dp`: DDP, ZeRO-1/2/3, FSDP, HSDP) and only the part
the neighbouring layers' compute cannot hide is added. Then the optimizer step (memory bound, ~32 B per
parameter it updates).

FLOPs are counted as the papers count them (Narayanan et al. 2021 Eq. 3; Korthikanti et al. 2022 Sec. 6;
`perf_ops.step_flops`): every GEMM of the forward, no causal halving, x3 for forward + backward. MFU counts
only those, against the bf16 peak (also for FP8 runs, as Llama 3 and torchtitan report it); HFU adds what is
recomputed.

GPUs, fabrics and the fitted constants: `labkit.parallel.hardware`. Validated against
`labkit/data/published_runs.json` (`labkit.parallel.published_runs`, `bench/planner_heldout.py`).
Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.errors import ConfigError, choices_error
from labkit.parallel import comm, perf_ops
from labkit.parallel.hardware import (ALIASES, ATTENTION_KERNELS, GPUS, MEMORY_EFFICIENCY,  # noqa: F401
                                      OPTIMIZER_BYTES, OPTIMIZER_STATES, PERF_FILE_ENV, STACKS, CONSTANTS,
                                      PERF_FILE_NAME, Efficiency, GpuSpec, attention_efficiency, comm_efficiency,
                                      optimizer_bytes, default_precision, default_attention, stack_efficiency,
                                      default_efficiency,
                                      gpu_family, gpu_spec, matmul_efficiency, read_perf_file,
                                      record_measurement)
from labkit.parallel.perf_dp import dp_time, exposed_behind
from labkit.parallel.perf_ops import (DEEPSPEED_P2P_EXPOSED, attention_flops,  # noqa: F401 (re-exported)
                                     layer_forward_flops, linear_flops,
                                     recompute_flops, step_flops)


SELECTIVE = ("core", "op")
PIPELINE_ENGINES = ("megatron", "deepspeed")
#: How a pipeline's stages get their layers (`Layout.pp_partition`).
PP_PARTITIONS = ("transformer", "transformer|embedding")


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
    eager: bool = False
    """Elementwise ops run as one eager PyTorch kernel each (no torch.compile, no fused kernels): more HBM traffic.
    Set by stack='eager'."""
    stack: str = "megatron"
    """Software stack (`hardware.STACKS`): 'megatron' (Megatron-Core/NeMo/TE: fused kernels), 'torch-compile' or
    'eager' (torch-native linears at `CONSTANTS['stack_efficiency.torch']` of the fused stack's GEMM rate)."""
    attention: str = ""
    """Attention kernel (`hardware.ATTENTION_KERNELS`): fa2, sdpa, fa3 (or cuDNN), triton, eager (= flash False);
    '' = the GPU's default (`hardware.default_attention`)."""
    optimizer_states: str = "fp32"
    """Adam's moments in fp32 or bf16 (the optimizer step's HBM bytes, `hardware.optimizer_bytes`)."""
    selective: str = "core"
    """What checkpointing='selective' recomputes: 'core' = the attention core (Korthikanti et al. 2022; a flash
    kernel keeps its output, nothing to redo); 'op' = torchtitan's per-op policy, every second matmul and all
    elementwise ops."""
    tp_overlap: bool = False
    """TP collectives split and overlapped with the GEMMs beside them (torchtitan's AsyncTP, Megatron's
    --tp-comm-overlap): only what the GEMMs cannot hide, and the contention share, stays exposed."""
    reduce_fp32: bool = False
    """Data-parallel gradient reductions in fp32 (torchtitan's FSDP default) rather than bf16: twice the bytes."""
    pipeline_engine: str = "megatron"
    """Pipeline point-to-point: 'megatron' (send_forward_recv_backward pairs) or 'deepspeed' (blocking
    rendezvous with both neighbours every step, which chain; Smith et al. 2022's MT-NLG, BLOOM). Both send
    1/tp of the boundary activation per rank (Megatron's scatter/gather; DeepSpeed's partitioned tensors)."""
    pp_partition: str = "transformer"
    """Which layers the pipeline stages share out: 'transformer' = the transformer layers evenly (Megatron-LM;
    DeepSpeed's partition method 'type:transformer'), so the last stage runs the LM head and loss on top of its
    share; 'transformer|embedding' = the input embedding and the tied LM head counted as layers too (DeepSpeed's
    'type:transformer|embedding', BLOOM): the first and last stages each give up a transformer layer for them."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batch", "microbatches", "interleave", "cp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}; it must be a positive integer")
        if self.interleave > 1 and self.pp == 1:
            raise ConfigError(f"interleave={self.interleave} needs pipeline parallelism (pp > 1): it splits each "
                              "pipeline rank's layers into chunks; use interleave 1")
        for name, allowed in (("selective", SELECTIVE), ("pipeline_engine", PIPELINE_ENGINES),
                              ("pp_partition", PP_PARTITIONS)):
            if getattr(self, name) not in allowed:
                raise choices_error(name, getattr(self, name), allowed)
        for name, allowed in (("stack", STACKS), ("attention", ("",) + tuple(ATTENTION_KERNELS)),
                              ("optimizer_states", OPTIMIZER_STATES)):
            if getattr(self, name) not in allowed:
                raise choices_error(name, getattr(self, name), allowed)
        if self.stack == "eager":
            object.__setattr__(self, "eager", True)
        if self.attention == "eager":
            object.__setattr__(self, "flash", False)
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


def _rates(gpu: str, lay: Layout, efficiency: Efficiency) -> perf_ops.Rates:
    """What one GPU of `gpu` sustains for this layout (FP8: the linears on the FP8 tensor cores)."""
    g = gpu_spec(gpu)
    hbm = g.hbm_gbs * 1e9 * MEMORY_EFFICIENCY
    attention = g.peak_tflops * 1e12 * attention_efficiency(
        gpu, default_attention(gpu) if lay.attention in ("", "eager") else lay.attention)
    stack = stack_efficiency(gpu, lay.stack)
    if lay.precision == "fp8":
        if not g.fp8_tflops:
            raise ConfigError(f"precision fp8 on {gpu}: it has no FP8 tensor cores; use bf16")
        gemm = g.peak_tflops * 1e12 * default_efficiency(gpu, "bf16").value
        return perf_ops.Rates(g.fp8_tflops * 1e12 * efficiency.value * stack, gemm, attention, hbm, linear_bytes=1.0)
    rate = g.peak_tflops * 1e12 * efficiency.value
    return perf_ops.Rates(rate * stack, rate, attention, hbm)


@dataclass(frozen=True)
class _Slot:
    """Seconds of one micro-batch on the slowest stage, by kind and pass."""

    fwd_mm: float
    bwd_mm: float
    redo_mm: float
    fwd_mem: float
    bwd_mem: float
    redo_mem: float

    @property
    def matmul(self) -> float:
        return self.fwd_mm + self.bwd_mm + self.redo_mm

    @property
    def memory(self) -> float:
        return self.fwd_mem + self.bwd_mem + self.redo_mem


def stage_kinds(layers: int, lay: Layout) -> list[tuple[int, bool]]:
    """(transformer layers, runs the LM head and loss) of the stages that can be a pipeline's slowest.

    'transformer': ceil(L / p) layers on the last stage, with the head (every stage has at most that many).
    'transformer|embedding': L + 2 items in p balanced parts of at most k = ceil((L + 2) / p); the first stage is
    [embedding | k - 1 layers], the last [k - 1 layers | LM head], a middle one up to k layers (BLOOM: 72 = 12 x 6,
    "pp rank 0: [embed | 5 transformer blocks] ... pp rank 11: [5 transformer blocks | embed]"). The head is
    never recomputed (DeepSpeed checkpoints only transformer layers, Megatron only its transformer block); the
    input embedding is a lookup, not counted."""
    p = lay.pp
    if lay.pp_partition == "transformer" or p == 1:
        return [(math.ceil(layers / p), True)]
    k = math.ceil((layers + 2) / p)
    return [(k - 1, True)] + ([(k, False)] if p > 2 else [])


def _compute(spec, lay: Layout, seq: int, layers: int, rates: perf_ops.Rates, head: bool = True) -> _Slot:
    """One micro-batch's compute on a stage of `layers` transformer layers (`head`: + the LM head and loss):
    GEMMs and attention (`labkit.parallel.perf_ops`), elementwise kernels at HBM speed (the backward's twice the
    forward's bytes; FP8 adds its casts), recomputation by checkpointing policy."""
    b, t, q_seq = lay.micro_batch, lay.tp, seq // lay.cp
    tok = b * q_seq
    lin = layers * perf_ops.linears_s(spec, tok, t, rates, lay.ep)
    att = layers * perf_ops.attention_s(spec, b, seq, q_seq, t, rates, lay.flash)
    head = perf_ops.head_s(spec, tok, t, rates) if head else 0.0
    per_tok = layers * tok / rates.hbm  # seconds per (byte per token and layer)
    elem = per_tok * (perf_ops.elementwise_bytes(spec, tp=t, sp=lay.sequence_parallel and t > 1, seq=seq,
                                                 flash=lay.flash, eager=lay.eager)
                      + perf_ops.cp_merge_bytes(spec, t, lay.cp))
    core = per_tok * perf_ops.softmax_bytes(spec, t, seq, lay.eager) if not lay.flash else 0.0
    cast_f, cast_b = (per_tok * x for x in perf_ops.fp8_cast_bytes(spec, tok, t, fused=lay.stack == "megatron")) \
        if lay.precision == "fp8" else (0, 0)
    loss = tok * perf_ops.loss_bytes(spec, t, lay.eager) / rates.hbm if head else 0.0
    if lay.checkpointing == "full":
        redo_mm, redo_mem = lin + att, elem + cast_f
    elif lay.checkpointing == "selective" and lay.selective == "op":
        redo_mm = layers * perf_ops.linears_s(spec, tok, t, rates, lay.ep, every_other=True)
        redo_mem = elem - core + cast_f
    elif lay.checkpointing == "selective":
        redo_mm, redo_mem = (0.0, 0.0) if lay.flash else (att, core)
    else:
        redo_mm = redo_mem = 0.0
    attn_bwd = perf_ops.ATTENTION_BACKWARD if lay.flash else 2.0
    return _Slot(fwd_mm=lin + att + head, bwd_mm=2 * lin + attn_bwd * att + 2 * head, redo_mm=redo_mm,
                 fwd_mem=elem + cast_f + loss / 3, bwd_mem=2 * elem + cast_b + 2 * loss / 3, redo_mem=redo_mem)


def _tp_collectives(lay: Layout) -> float:
    """All-reduce equivalents per layer and micro-batch of tensor parallelism (Narayanan et al. 2021 Sec. 2.3:
    2 forward, 2 backward; sequence parallelism's all-gather + reduce-scatter pairs move the same bytes). A fully
    recomputed forward redoes its 2; torchtitan's per-op policy saves the reduce-scatters' outputs but redoes
    the all-gathers (half an all-reduce each) -- or, without sequence parallelism, the 2 all-reduces."""
    if lay.checkpointing == "full":
        return 6
    if lay.checkpointing == "selective" and lay.selective == "op":
        return 5 if lay.sequence_parallel and lay.tp > 1 else 6
    return 4


def _tp_overlapped(spec, lay: Layout, tok: int, tp_s: float, n_ar: float, rates: perf_ops.Rates) -> float:
    """Exposed TP seconds when each collective is split into tp chunks and overlapped with the GEMM next to it
    (AsyncTP): an all-gather only behind the column-parallel GEMMs it feeds, a reduce-scatter only behind the
    row-parallel GEMM it drains (`perf_ops.tp_blocks_s`); the first chunk waits, the rest hides up to the GEMM's
    time, minus the contention share (`perf_dp.exposed_behind`). Backward and recomputed passes mirror it."""
    half = tp_s / (2 * n_ar)  # one all-gather or reduce-scatter of one layer and pass
    t = lay.tp
    blocks = perf_ops.tp_blocks_s(spec, tok, t, rates)
    if not blocks:  # no row-parallel linear to pair with: nothing known to hide behind
        return tp_s
    per_pass = sum(half / t + exposed_behind(half * (t - 1) / t, gemm) for col, row in blocks for gemm in (col, row))
    return per_pass * n_ar / len(blocks)  # a pass of a layer is len(blocks) all-reduce equivalents


def step_time(spec, lay: Layout, *, seq: int, gpu: str, gpus_per_node: int, efficiency: Efficiency,
              params_on_gpu: float | None = None, inter_node_gbps: float | None = None) -> StepTime:
    """The time model of the module docstring for `spec` (a `labkit.memory.params.ModelSpec`)."""
    g = gpu_spec(gpu)
    inter = inter_node_gbps or g.inter_node_gbps
    gpus = lay.dp * lay.tp * lay.pp * lay.cp
    t = lay.tp
    rates = _rates(gpu, lay, efficiency)
    tok = lay.micro_batch * seq // lay.cp  # this GPU's tokens of a micro-batch (its queries still see all seq keys)
    act = tok * spec.arch["hidden"] * 2  # one (b, s, h) bf16 activation
    nvlink = g.nvlink_gbs * 1e9 * comm_efficiency("nvlink")
    network = inter / 8 * 1e9 * comm_efficiency("network")
    pp_bytes, pp = perf_ops.pp_cost(lay, act, gpus, gpus_per_node, nvlink, network)

    def stage(layers: int, head: bool) -> tuple:
        c = _compute(spec, lay, seq, layers, rates, head)
        n_ar = _tp_collectives(lay) * layers
        tp_bytes = n_ar * comm.bytes_sent("all_reduce", act, t)
        tp = tp_bytes / nvlink
        if lay.tp_overlap and t > 1:
            tp = _tp_overlapped(spec, lay, tok, tp, n_ar, rates)
        cp_bytes, ep_bytes = perf_ops.cp_ep_bytes(spec, lay, tok, layers)
        cp = cp_bytes / (nvlink if t * lay.cp <= gpus_per_node else network)
        ep = ep_bytes / (nvlink if gpus <= gpus_per_node else network)
        return c.matmul + c.memory + tp + pp + cp + ep, layers, c, tp, tp_bytes, cp, cp_bytes, ep, ep_bytes

    # 1F1B's slot is the slowest stage's (the others wait for it in the steady state)
    slot, layers, c, tp, tp_bytes, cp, cp_bytes, ep, ep_bytes = max(
        (stage(n, head) for n, head in stage_kinds(spec.arch["layers"], lay)), key=lambda kind: kind[0])
    m = lay.microbatches
    pipeline = comm.step_slots(lay.pp, m, lay.interleave) * slot
    bubble = comm.bubble_fraction(lay.pp, m, lay.interleave)
    params = params_on_gpu if params_on_gpu is not None else spec.params / (t * lay.pp)
    fwd_s = c.fwd_mm + c.fwd_mem + tp * 2 / _tp_collectives(lay)
    dp = dp_time(lay, gpu=g, layers=layers, params_on_gpu=params, fwd_s=fwd_s, bwd_s=slot - fwd_s,
                 gpus_per_node=gpus_per_node, inter_node_gbps=inter)
    d = lay.dp * lay.cp
    updated = params / (d if lay.zero else 1)
    optimizer = optimizer_bytes(lay.optimizer_states) * updated / rates.hbm
    step = pipeline + dp.exposed + optimizer
    tokens = lay.micro_batch * m * lay.dp * seq
    model, hardware = step_flops(spec, tokens, seq, lay.checkpointing, lay.flash, lay.selective)
    peak_all = gpus * g.peak_tflops * 1e12
    return StepTime(matmul_s=m * c.matmul, nonmatmul_s=m * c.memory, tp_s=m * tp, pp_s=m * pp, dp_s=dp.exposed,
                    optimizer_s=optimizer, bubble=bubble, step_s=step, model_flops=model,
                    hardware_flops=hardware, mfu=model / (peak_all * step), hfu=hardware / (peak_all * step),
                    tflops_per_gpu=hardware / gpus / step / 1e12,
                    comm_bytes={"tp": int(m * tp_bytes), "pp": int(m * pp_bytes), "dp": int(dp.bytes),
                                **({"cp": int(m * cp_bytes)} if lay.cp > 1 else {}),
                                **({"ep": int(m * ep_bytes)} if lay.ep > 1 else {})},
                    cp_s=m * cp, ep_s=m * ep, tokens_per_s_per_gpu=tokens / step / gpus, dp_total_s=dp.seconds)


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
                                          default_precision(gpu))
    t = step_time(spec, layout, seq=seq, gpu=gpu, gpus_per_node=gpus_per_node, efficiency=eff,
                  inter_node_gbps=inter_node_gbps)
    return priced(t, tokens, layout.dp * layout.microbatches * layout.micro_batch * seq, gpus, price_per_gpu_hour,
                  eff)


def priced(t, tokens: float, tokens_per_step: int, gpus: int, price_per_gpu_hour: float,
           efficiency: Efficiency) -> Budget:
    """The `Budget` of `tokens` tokens at `t`'s step time (a `StepTime`, or a planner `Option`: step_s, mfu, hfu,
    tflops_per_gpu), `tokens_per_step` a step."""
    steps = math.ceil(tokens / tokens_per_step)
    seconds = steps * t.step_s
    hours = seconds / 3600 * gpus
    return Budget(tokens=tokens, gpus=gpus, steps=steps, step_s=t.step_s, days=seconds / 86400, gpu_hours=hours,
                  cost=hours * price_per_gpu_hour, mfu=t.mfu, hfu=t.hfu, tflops_per_gpu=t.tflops_per_gpu,
                  efficiency=efficiency)
