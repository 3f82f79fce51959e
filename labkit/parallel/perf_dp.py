"""Data-parallel communication of one step, layer by layer, and how much of it the compute hides.

Pure Python, no torch. Bytes come from `labkit.parallel.comm` (ring collectives); this module decides WHICH
collectives run, HOW OFTEN, over WHICH link, and WHAT compute can hide them (Rajbhandari et al. 2020, ZeRO
Sec. 7; Zhao et al. 2023, FSDP Sec. 3):

  stage            per layer and micro-batch (S = the layer's bf16 parameter bytes on this GPU)
  DDP (zero 0)     one all-reduce of the gradients per step, bucketed behind the last micro-batch's backward
  ZeRO-1           one reduce-scatter per step (behind the last backward) + one all-gather of the updated
                   parameters (prefetched behind the first micro-batch's forward)
  ZeRO-2           a reduce-scatter every micro-batch (the gradients stay sharded) + ZeRO-1's all-gather;
                   Llama 3's FSDP "without reshard after forward" (Dubey et al. 2024 Sec. 3.3.2)
  ZeRO-3 / FSDP    every micro-batch: an all-gather before the forward, another before the backward, a
                   reduce-scatter after it; DeepSpeed ZeRO-3 gathers once more for a fully recomputed forward,
                   torch FSDP recomputes inside the backward's unshard (`Layout.fsdp`)
  HSDP             ZeRO-3 inside a shard group + an all-reduce of each gradient shard across the replicas

Overlap: a layer's collective runs while the neighbouring layer computes (prefetch, bucketed reduce), so per
layer only max(0, comm - compute) is exposed, plus the first layer's gather that nothing precedes, plus the
share (1 - overlap efficiency) of the overlapped time that contention for SMs and HBM takes back. The
per-GPU micro-batch shrinks as dp grows at a fixed global batch, so the same bytes meet less compute.
`dp_overlap=False` (Megatron-LM before 2023) exposes the once-per-step collectives entirely. On an interleaved
Megatron pipeline the once-per-step collectives run chunk by chunk behind the later chunks' compute (`_per_chunk`).

Link: the slowest of the group. A group inside one node runs on NVLink; a group that spans nodes runs at the
inter-node bandwidth PER GPU (its ring crosses a NIC at every node boundary). Ranks are placed in
Megatron-LM's order (tp, cp fastest, then dp, then pp), so dp members share a node when tp x cp < GPUs per
node. NCCL can stripe one ring over all of a node's NICs and beat this for groups with many members per
node; the 2021 runs (Narayanan et al. 2021: Megatron's DDP, DeepSpeed's ZeRO-3 in Table 2) scale like the
per-GPU NIC, and that is what the model assumes for them. Torch FSDP (`Layout.fsdp`: torchtitan, llm-foundry,
Megatron-FSDP) and, since issue 42, Megatron-Core's distributed optimizer stripe (`stripes`): one flat
all-gather / reduce-scatter per layer or gradient bucket, which NCCL splits into as many channels
as the group has members on a node, each crossing the node boundary on its own NIC -- the ring's inter-node
bandwidth is those NICs together, up to NVLink's. Without it the multi-node FSDP rows cannot be reproduced
(MosaicML's 13B on 64 H100s moves ~100 GB per GPU in a 0.85 s step: more than twice one 400 Gb/s NIC). Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.parallel import comm
from labkit.parallel import hardware
from labkit.parallel.hardware import comm_efficiency


@dataclass(frozen=True)
class DpTime:
    """Data-parallel traffic of one step on one GPU."""

    bytes: float
    """Bytes this GPU sends for data parallelism per step."""
    seconds: float
    """Time the collectives take on their link."""
    exposed: float
    """Seconds of it the compute does not hide."""


def members_per_node(tp: int, cp: int, dp: int, gpus_per_node: int) -> int:
    """DP ranks of one group sharing a node (Megatron order: tp, cp innermost, then dp)."""
    return max(1, min(dp, gpus_per_node // (tp * cp)))


def link_bandwidth(gpu, group: int, per_node: int, inter_node_gbps: float, rails: int = 1) -> float:
    """Bus bandwidth (B/s) of a ring over `group` ranks, `per_node` of them on each node; across nodes the
    collective stripes its channels over `rails` NICs per node (bounded by NVLink, which every channel crosses)."""
    nvlink = gpu.nvlink_gbs * 1e9 * comm_efficiency("nvlink")
    if group <= 1:
        return float("inf")
    if group <= per_node:
        return nvlink
    return min(nvlink, rails * inter_node_gbps / 8 * 1e9 * comm_efficiency("network"))


def stripes(lay) -> bool:
    """Whether `lay`'s data-parallel rings cross nodes on all of a node's NICs (one per member on the node) rather
    than one: torch FSDP's flat per-layer collectives, and Megatron-Core's distributed optimizer (ZeRO-1/2 on the
    megatron stack and pipeline engine, overlapped), whose contiguous gradient buckets (>= 40M parameters,
    `param_and_grad_buffer`) go out as one reduce-scatter / all-gather each -- messages of hundreds of MB that
    NCCL spreads over all its channels, one per NIC on rail-optimized DGX/HGX nodes (8 NICs for 8 GPUs). DDP
    and the DeepSpeed engine keep one NIC per ring: Narayanan 2021's ZeRO-3 rows (calibration) scale like it,
    and the 2021 DDP rows cannot tell (+-2 %)."""
    return lay.fsdp or (lay.zero in (1, 2) and lay.stack == "megatron" and lay.pipeline_engine == "megatron"
                        and lay.dp_overlap)


def exposed_behind(comm_s: float, compute_s: float) -> float:
    """Seconds a collective adds to the compute it overlaps: what sticks out, plus the share of the overlap
    that contention takes back (`overlap_efficiency`)."""
    return max(0.0, comm_s - compute_s) + (1 - hardware.CONSTANTS["overlap_efficiency"]) * min(comm_s, compute_s)


def dp_time(lay, *, gpu, layers: int, params_on_gpu: float, fwd_s: float, bwd_s: float, gpus_per_node: int,
            inter_node_gbps: float) -> DpTime:
    """Per-layer DP collectives of `lay` (a `perf_model.Layout`) and the part the compute cannot hide.

    `fwd_s` / `bwd_s`: compute seconds of ONE micro-batch's forward / backward (recomputation included) on
    this stage; `params_on_gpu`: parameters this GPU holds before ZeRO (its tp x pp share)."""
    d = lay.dp * lay.cp  # cp ranks hold replicas too: they reduce gradients with the dp ranks
    if d == 1:
        return DpTime(0.0, 0.0, 0.0)
    per_node = members_per_node(lay.tp, 1, lay.dp, gpus_per_node) * lay.cp
    m, layer_bytes = lay.microbatches, 2 * params_on_gpu / layers  # bf16 weights and gradients
    f, b = fwd_s / layers, bwd_s / layers
    shard = min(lay.shard_group or d, d) if lay.zero else d
    bw = link_bandwidth(gpu, shard, per_node, inter_node_gbps, rails=per_node if stripes(lay) else 1)
    grad_bytes = layer_bytes * (2 if lay.reduce_fp32 else 1)  # torchtitan's FSDP reduces gradients in fp32
    ag = comm.bytes_sent("all_gather", layer_bytes, shard)
    rs = comm.bytes_sent("reduce_scatter", grad_bytes, shard)
    gather, scatter = ag / bw, rs / bw
    regather = lay.zero == 3 and lay.checkpointing == "full" and not lay.fsdp  # DeepSpeed re-gathers for the recompute
    n_ag, n_rs = comm.dp_passes(lay.zero, m, regather=regather)  # per layer and step (K micro-batches: K x)
    sent = layers * (n_ag * (rs if lay.zero == 0 else ag) + n_rs * rs)  # DDP's all-gather moves the summed grads
    if lay.zero == 3:
        n_gather = n_ag // m
        per_mb = layers * (exposed_behind(gather, f) + exposed_behind((n_gather - 1) * gather + scatter, b)) + gather
        exposed, seconds = m * per_mb, m * layers * (n_gather * gather + scatter)
    else:
        exposed, seconds = _stage012(lay, m, layers, gather, scatter, f, b)
    if lay.zero and shard < d:  # HSDP: all-reduce each gradient shard across the d / shard replicas, once
        replicas = d // shard
        cross = link_bandwidth(gpu, replicas, 1, inter_node_gbps)
        ar = comm.bytes_sent("all_reduce", grad_bytes / shard, replicas)
        seconds += layers * ar / cross
        exposed += layers * exposed_behind(ar / cross, b) if lay.dp_overlap else layers * ar / cross
        sent += layers * ar
    return DpTime(sent, seconds, exposed)


def _stage012(lay, m: int, layers: int, gather: float, scatter: float, f: float, b: float) -> tuple[float, float]:
    """(exposed, total) seconds of DDP / ZeRO-1 / ZeRO-2 traffic per step."""
    if lay.zero == 0:
        total = layers * 2 * scatter  # all-reduce = reduce-scatter + all-gather
        if lay.dp_overlap and _chunked(lay):
            return _per_chunk(lay, layers, 2 * scatter, b), total
        return (layers * exposed_behind(2 * scatter, b) if lay.dp_overlap else total), total
    param_gather = layers * gather  # updated parameters, once per step
    if lay.zero == 1:
        total = layers * scatter + param_gather
        if not lay.dp_overlap:
            return total, total
        if _chunked(lay):
            return _per_chunk(lay, layers, scatter, b) + _per_chunk(lay, layers, gather, f) + gather, total
        return layers * (exposed_behind(scatter, b) + exposed_behind(gather, f)) + gather, total
    total = m * layers * scatter + param_gather  # ZeRO-2: the gradients are reduced every micro-batch
    if not lay.dp_overlap:
        return total, total
    return m * layers * exposed_behind(scatter, b) + layers * exposed_behind(gather, f) + gather, total


def _chunked(lay) -> bool:
    """Megatron-LM's interleaved schedule syncs each model chunk's gradients (and gathers its parameters) on
    its own, as soon as that chunk's last backward (before its first forward) is done."""
    return lay.pp > 1 and lay.interleave > 1 and lay.pipeline_engine == "megatron"


def _per_chunk(lay, layers: int, comm_s: float, compute_s: float) -> float:
    """Exposed seconds of a once-per-step collective (`comm_s` per layer) on an interleaved Megatron pipeline.

    Megatron-core's interleaved 1F1B runs the last pp micro-batches' backwards chunk by chunk, deepest first
    (chunk v-1, then v-2, ... 0 on the first stage), and launches a chunk's gradient reduce-scatter (its
    `grad_sync_func`) when that chunk's last backward ends; chunk k's sync therefore runs behind the k x pp
    chunk backwards that follow it. The parameter all-gather mirrors it at the next step's start (chunk 0's
    forwards first; `param_sync_func`). Queued on one stream: chunk k (k >= 1) starts when it is ready and
    the previous one is done, whatever outruns the last backward is exposed; chunk 0 overlaps only its own
    last micro-batch, layer by layer, as without interleaving; the overlapped part pays the contention share
    (`overlap_efficiency`) like every overlapped collective. `compute_s`: one layer of one micro-batch."""
    v, pp = lay.interleave, lay.pp
    per_chunk = layers / v
    chunk_comm, slot = per_chunk * comm_s, per_chunk * compute_s * pp  # pp chunk passes between two chunks
    done = float("-inf")
    for k in range(v - 1, 0, -1):  # chunk k ready k x slot before the last chunk-0 pass ends
        done = max(done, -k * slot) + chunk_comm
    backlog = max(0.0, done)
    hidden = (v - 1) * chunk_comm - backlog
    contention = (1 - hardware.CONSTANTS["overlap_efficiency"]) * max(0.0, hidden)
    return backlog + contention + per_chunk * exposed_behind(comm_s, compute_s)
