"""Step time, MFU and HFU of one transformer layout on N GPUs: the planner's time model.

Pure Python, no torch. Per optimizer step, on the slowest pipeline stage (the last one: it also runs
the LM head), one micro-batch costs
  matmul      (3 + recompute) x forward GEMM FLOPs / (peak x achievable matmul efficiency)
  non-matmul  bytes / (HBM bandwidth x MEMORY_EFFICIENCY): norms, softmax, GeLU, dropout, residuals are
              memory bound; each saved activation (`labkit.memory.activations`) is written once and read
              once in the forward, twice that in the backward, once more when recomputed
  TP          all-reduces on NVLink, 2 forward + 2 backward per layer (+ 2 when the whole layer is
              recomputed), NOT overlapped (Narayanan et al. 2021 Sec. 3.2: on the critical path)
  PP          one send forward, one backward of b*s*h/t bytes (scatter-gather, Sec. 4.1)
and the step is (m + (p - 1) / v) micro-batch slots (1F1B; interleaved with v chunks per GPU). The
data-parallel gradient reduce overlaps the last micro-batch's backward (DDP buckets; only the excess is
exposed); ZeRO-3 parameter gathers are prefetched under all the compute. Then the optimizer step
(memory bound, ~32 B per parameter it updates).

FLOPs are counted as the papers count them (Narayanan et al. 2021 Eq. 3; Korthikanti et al. 2022
Sec. 6): every GEMM of the forward (2 x fan_in x fan_out per token and linear, 4 s h per token for
QK^T and AV, no causal halving, 2 h V for the logits), x3 for forward + backward. MFU counts only
those; HFU adds the recomputed forward (full: every layer; selective: the attention core).

The achievable matmul efficiency per GPU and precision is a documented default (`DEFAULT_EFFICIENCY`),
replaced by the node's own measurement when one is on file (`matmul_efficiency`, `PERF_FILE_ENV`).
Validated in tests against `labkit/data/published_runs.json` (`labkit.parallel.published_runs`).
Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from labkit.cache import cache_root
from labkit.errors import ConfigError, choices_error
from labkit.parallel import comm


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: memory, peak and the bandwidths the time model uses (per GPU, per direction)."""

    memory_gb: float
    """HBM in GB (10^9 B), as the profiles count it."""
    peak_tflops: float
    """Dense bf16 (V100: fp16) tensor-core peak."""
    nvlink_gbs: float
    """NVLink bandwidth inside a node, GB/s per direction."""
    network_gbs: float
    """Inter-node bandwidth per GPU, GB/s (one InfiniBand NIC per GPU as in DGX nodes)."""
    hbm_gbs: float = 2039.0
    """HBM bandwidth, GB/s (data sheet)."""


#: Data sheets: A100 NVLink3 600 GB/s bidirectional, HDR 200 Gb/s, HBM2e 2039 GB/s (80GB) / 1555 (40GB);
#: H100 SXM NVLink4 900, NDR 400 Gb/s, HBM3 3350; V100 NVLink2 300, EDR 100 Gb/s, HBM2 900.
GPUS = {
    "a100-80gb": GpuSpec(80.0, 312.0, 300.0, 25.0, 2039.0),
    "a100-40gb": GpuSpec(40.0, 312.0, 300.0, 25.0, 1555.0),
    "h100-80gb": GpuSpec(80.0, 989.0, 450.0, 50.0, 3350.0),
    "v100-32gb": GpuSpec(32.0, 125.0, 150.0, 12.5, 900.0),
}
#: Share of the HBM data-sheet bandwidth that fused elementwise kernels reach (assumption: copy
#: kernels reach ~80-90 %; norms and softmax a little less).
MEMORY_EFFICIENCY = 0.8
#: NCCL bus bandwidth over the link's data sheet for large messages (assumption: nccl-tests on DGX
#: A100 report ~230 GB/s all-reduce bus bandwidth on 300 GB/s NVLink).
COMM_EFFICIENCY = 0.75
#: Bytes the optimizer step reads and writes per parameter it updates (Adam, mixed precision: fp32
#: master, m, v and gradient read, three written back, bf16 weight written).
OPTIMIZER_BYTES = 32
#: Where `labkit preflight` / `labkit bench` write the node's measured matmul efficiency, and the
#: environment variable that points elsewhere (format: `read_perf_file`).
PERF_FILE_NAME = "matmul_efficiency.json"  # in labkit.cache.cache_root()
PERF_FILE_ENV = "LABKIT_MATMUL_FILE"


@dataclass(frozen=True)
class Efficiency:
    """Achievable share of the dense tensor-core peak for the model's GEMMs, and where it came from."""

    value: float
    source: str


#: Defaults by GPU family and precision. The A100 value is the one free parameter of the model, fitted
#: to the published runs (tests/test_planner_calibration.py checks every row within 20 %); it sits below
#: the best single GEMM (~86 % of peak in S. Bekman's ml-engineering "maximum achievable matmul FLOPS"
#: table, not re-measured here) because transformer-shaped GEMMs, split by TP, are smaller.
DEFAULT_EFFICIENCY = {
    ("a100", "bf16"): Efficiency(0.72, "A100 bf16 default fitted to 26 published runs in labkit/data/"
                                       "published_runs.json: Narayanan et al. 2021, Korthikanti et al. 2022"),
    ("h100", "bf16"): Efficiency(0.70, "H100 bf16 default: an assumption, no H100 row in the published runs yet"),
    ("v100", "fp16"): Efficiency(0.75, "V100 fp16 default: an assumption, no V100 row in the published runs yet"),
}


def gpu_family(gpu: str) -> str:
    return gpu.split("-")[0]


def read_perf_file(path: Path, gpu: str, precision: str) -> Efficiency | None:
    """The measured efficiency for `gpu` and `precision` in a perf file, or None if it has none.

    Format (JSON): {"measurements": [{"gpu": "a100-80gb", "precision": "bf16", "efficiency": 0.78,
    "tflops": 243.4, "tool": "labkit preflight", "measured_at": "2026-11-25T01:00:00Z"}, ...]}.
    `efficiency` = achieved dense GEMM TFLOPS on transformer shapes / the GPU's peak, in (0, 1]."""
    try:
        data = json.loads(path.read_text())
        rows = data["measurements"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read matmul measurements from {path}: {exc}; rerun `labkit preflight` "
                          f"or delete the file (format: labkit.parallel.perf_model.read_perf_file)") from None
    for row in rows:
        if row.get("gpu") == gpu and row.get("precision", "bf16") == precision:
            value = row.get("efficiency")
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ConfigError(f"{path}: efficiency={value!r} for {gpu}; it must be in (0, 1]")
            tool = row.get("tool", "a measurement")
            return Efficiency(float(value), f"measured on this node by {tool} ({path})")
    return None


def record_measurement(gpu: str, precision: str, tflops: float, *, tool: str, path: Path | None = None) -> Path:
    """Add (or replace) this node's measured matmul efficiency in the perf file the planner reads.

    efficiency = tflops / the GPU's peak (GPUS). Written by `labkit preflight` on a GPU node; the file is
    `$LABKIT_MATMUL_FILE`, else matmul_efficiency.json in labkit's cache folder."""
    if gpu not in GPUS:
        raise choices_error("gpu", gpu, GPUS)
    path = Path(path or os.environ.get(PERF_FILE_ENV) or cache_root() / PERF_FILE_NAME).expanduser()
    rows = []
    if path.exists():
        try:
            rows = json.loads(path.read_text())["measurements"]
        except (OSError, ValueError, KeyError, TypeError):
            rows = []  # an unreadable file is replaced by this measurement
    row = {"gpu": gpu, "precision": precision, "efficiency": round(min(1.0, tflops / GPUS[gpu].peak_tflops), 4),
           "tflops": round(tflops, 2), "tool": tool,
           "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    rows = [r for r in rows if not (r.get("gpu") == gpu and r.get("precision", "bf16") == precision)] + [row]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"measurements": rows}, indent=1))
    tmp.replace(path)
    return path


def matmul_efficiency(gpu: str, precision: str = "bf16", *, override: float | None = None,
                      path: Path | None = None) -> Efficiency:
    """The efficiency to plan with: `override` > the node's perf file > the documented default."""
    if override is not None:
        if not 0 < override <= 1:
            raise ConfigError(f"matmul_efficiency={override!r}; it must be in (0, 1], e.g. 0.8")
        return Efficiency(float(override), "given by the caller (matmul_efficiency)")
    path = Path(path or os.environ.get(PERF_FILE_ENV) or cache_root() / PERF_FILE_NAME).expanduser()
    if path.exists():
        measured = read_perf_file(path, gpu, precision)
        if measured:
            return measured
    key = (gpu_family(gpu), precision)
    if key not in DEFAULT_EFFICIENCY:
        raise choices_error("gpu/precision", f"{gpu}/{precision}", [f"{g}/{p}" for g, p in DEFAULT_EFFICIENCY])
    return DEFAULT_EFFICIENCY[key]


@dataclass(frozen=True)
class Layout:
    """How one step is split: parallel degrees, micro-batching, recomputation, attention kernel."""

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


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step by component, and the utilizations they imply."""

    matmul_s: float
    nonmatmul_s: float
    tp_s: float
    pp_s: float
    dp_s: float
    """Data-parallel communication NOT hidden under the backward / compute."""
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


def layer_forward_flops(spec, seq: int) -> float:
    """Forward FLOPs of one layer per token: the GEMMs (from the spec's linears) + QK^T and AV."""
    gemms = 2 * sum(lin.fan_in * lin.fan_out for lin in spec.linears)
    if spec.arch.get("experts"):  # MoE: each token runs k SwiGLU experts (3 h x inter GEMMs) + the router
        a = spec.arch
        gemms += 2 * (a["top_k"] * 3 * a["hidden"] * a["intermediate"] + a["experts"] * a["hidden"])
    return gemms + 4 * seq * spec.arch["heads"] * spec.arch["head_dim"]


def recompute_flops(spec, seq: int, checkpointing: str) -> float:
    """Forward FLOPs per token and layer that the backward redoes."""
    if checkpointing == "full":
        return layer_forward_flops(spec, seq)
    if checkpointing == "selective":  # the attention core only (Korthikanti Sec. 5)
        return 4 * seq * spec.arch["heads"] * spec.arch["head_dim"]
    return 0.0


def step_flops(spec, tokens: int, seq: int, checkpointing: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step of `tokens` tokens."""
    layers, logits = spec.arch["layers"], 2 * spec.arch["hidden"] * spec.arch["vocab"]
    model = 3 * tokens * (layers * layer_forward_flops(spec, seq) + logits)
    return model, model + tokens * layers * recompute_flops(spec, seq, checkpointing)


def _nonmatmul_bytes(spec, lay: Layout, seq: int, gpt: bool) -> float:
    """HBM bytes per layer and micro-batch moved by elementwise kernels (forward, backward, recompute)."""
    from labkit.memory import activations as act

    st = act.Step(micro_batch=lay.micro_batch, seq=seq, act_bytes=2, flash=lay.flash, tp=lay.tp,
                  sp=lay.sequence_parallel and lay.tp > 1)
    layer = (act.gpt_layer if gpt else act.llama_layer)(spec.arch, st)
    saved = layer.stored(st)
    redo = {"full": saved, "selective": layer.core / lay.tp, "none": 0.0}[lay.checkpointing]
    return 2 * saved + 4 * saved + 2 * redo  # written+read forward, twice in backward, recompute


def _dp_bandwidth(spec_gpu: GpuSpec, lay: Layout, gpus: int, gpus_per_node: int) -> float:
    """Bus bandwidth (B/s) of a data-parallel ring: NVLink inside a node; across nodes the members
    that share a node share its NICs (one per GPU), so k members per node move k x NIC."""
    if gpus <= gpus_per_node:
        return spec_gpu.nvlink_gbs * 1e9 * COMM_EFFICIENCY
    per_node = max(1, gpus_per_node // (lay.tp * lay.pp))
    return min(spec_gpu.nvlink_gbs, per_node * spec_gpu.network_gbs) * 1e9 * COMM_EFFICIENCY


def step_time(spec, lay: Layout, *, seq: int, gpu: str, gpus_per_node: int, efficiency: Efficiency,
              params_on_gpu: float | None = None) -> StepTime:
    """The time model of the module docstring for `spec` (a `labkit.memory.params.ModelSpec`)."""
    g = GPUS[gpu]
    gpus = lay.dp * lay.tp * lay.pp * lay.cp
    a, b, t = spec.arch, lay.micro_batch, lay.tp
    gpt = spec.kind == "gpt"
    layers = math.ceil(a["layers"] / lay.pp)
    flops_s = g.peak_tflops * 1e12 * efficiency.value
    tok = b * seq // lay.cp  # this GPU's tokens of a micro-batch (its queries still see all seq keys)
    fwd = layers * tok * layer_forward_flops(spec, seq) / t
    head = tok * 2 * a["hidden"] * a["vocab"] / t  # vocab-parallel LM head, on the last stage
    redo = layers * tok * recompute_flops(spec, seq, lay.checkpointing) / t
    matmul = (3 * fwd + 3 * head + redo) / flops_s
    nonmatmul = layers * _nonmatmul_bytes(spec, lay, seq // lay.cp, gpt) / (g.hbm_gbs * 1e9 * MEMORY_EFFICIENCY)
    act = tok * a["hidden"] * 2  # one (b, s, h) bf16 activation
    n_ar = (6 if lay.checkpointing == "full" else 4) * layers
    tp_bytes = n_ar * comm.bytes_sent("all_reduce", act, t)
    tp = tp_bytes / (g.nvlink_gbs * 1e9 * COMM_EFFICIENCY)
    pp_bytes = 2 * comm.bytes_sent("send_recv", act / t, 2) if lay.pp > 1 else 0.0  # forward + backward
    crosses = gpus > gpus_per_node and t * lay.pp > gpus_per_node
    pp = pp_bytes / ((g.network_gbs if crosses else g.nvlink_gbs) * 1e9 * COMM_EFFICIENCY)
    cp_bytes, ep_bytes = _cp_ep_bytes(spec, lay, tok, layers)
    bw = lambda inside: (g.nvlink_gbs if inside else g.network_gbs) * 1e9 * COMM_EFFICIENCY  # noqa: E731
    cp = cp_bytes / bw(t * lay.cp <= gpus_per_node)
    ep = ep_bytes / bw(gpus <= gpus_per_node)
    slot = matmul + nonmatmul + tp + pp + cp + ep
    m = lay.microbatches
    pipeline = comm.step_slots(lay.pp, m, lay.interleave) * slot
    bubble = comm.bubble_fraction(lay.pp, m, lay.interleave)
    params = params_on_gpu if params_on_gpu is not None else spec.params / (t * lay.pp)
    d = lay.dp * lay.cp  # cp ranks hold replicas too: they reduce gradients with the dp ranks
    if lay.zero == 3:  # gather for forward and backward, reduce-scatter, every micro-batch
        dp_bytes = 3 * m * comm.bytes_sent("all_gather", 2 * params, d)
        hidden = pipeline
    else:  # one gradient all-reduce (ZeRO-1/2: reduce-scatter + all-gather, same bytes)
        dp_bytes = comm.bytes_sent("all_reduce", 2 * params, d)
        hidden = (2 * fwd + 2 * head + redo) / flops_s  # the last micro-batch's backward
    dp_time = dp_bytes / _dp_bandwidth(g, lay, gpus, gpus_per_node) if d > 1 else 0.0
    dp_exposed = max(0.0, dp_time - hidden)
    updated = params / (d if lay.zero else 1)
    optimizer = OPTIMIZER_BYTES * updated / (g.hbm_gbs * 1e9 * MEMORY_EFFICIENCY)
    step = pipeline + dp_exposed + optimizer
    model, hardware = step_flops(spec, b * m * lay.dp * seq, seq, lay.checkpointing)
    peak_all = gpus * g.peak_tflops * 1e12
    return StepTime(matmul_s=m * matmul, nonmatmul_s=m * nonmatmul, tp_s=m * tp, pp_s=m * pp, dp_s=dp_exposed,
                    optimizer_s=optimizer, bubble=bubble, step_s=step, model_flops=model,
                    hardware_flops=hardware, mfu=model / (peak_all * step), hfu=hardware / (peak_all * step),
                    tflops_per_gpu=hardware / gpus / step / 1e12,
                    comm_bytes={"tp": int(m * tp_bytes), "pp": int(m * pp_bytes), "dp": int(dp_bytes),
                                **({"cp": int(m * cp_bytes)} if lay.cp > 1 else {}),
                                **({"ep": int(m * ep_bytes)} if lay.ep > 1 else {})},
                    cp_s=m * cp, ep_s=m * ep)


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
           gpu: str = "a100-80gb", gpus_per_node: int = 8, efficiency: Efficiency | None = None) -> Budget:
    """Days, GPU-hours and cost of `tokens` training tokens for `model` (a preset name or a
    `labkit.memory.params.ModelSpec`) with `layout` on `gpus` GPUs, from `step_time`.

    Narayanan et al. 2021 Eq. 4 estimate the same with 8 T P / (n X) at an assumed X TFLOPS per GPU."""
    from labkit.memory.estimate import check_topology
    from labkit.memory.params import model_spec

    check_topology(layout.dp, layout.tp, layout.pp, gpus)
    if tokens <= 0 or price_per_gpu_hour < 0:
        raise ConfigError(f"tokens={tokens!r}, price_per_gpu_hour={price_per_gpu_hour!r}: tokens must be "
                          "positive and the price not negative")
    spec = model_spec(model) if isinstance(model, str) else model
    if gpu not in GPUS:
        raise choices_error("gpu", gpu, GPUS)
    eff = efficiency or matmul_efficiency(gpu, "fp16" if gpu.startswith("v100") else "bf16")
    t = step_time(spec, layout, seq=seq, gpu=gpu, gpus_per_node=gpus_per_node, efficiency=eff)
    per_step = layout.dp * layout.microbatches * layout.micro_batch * seq
    steps = math.ceil(tokens / per_step)
    seconds = steps * t.step_s
    hours = seconds / 3600 * gpus
    return Budget(tokens=tokens, gpus=gpus, steps=steps, step_s=t.step_s, days=seconds / 86400, gpu_hours=hours,
                  cost=hours * price_per_gpu_hour, mfu=t.mfu, hfu=t.hfu, tflops_per_gpu=t.tflops_per_gpu,
                  efficiency=eff)
