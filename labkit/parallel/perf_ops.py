"""What one transformer layer's operators cost on one GPU: GEMMs, attention and the memory-bound rest.

Pure Python, no torch. `labkit.parallel.perf_model` adds these up per micro-batch; the reasons small models and
thin GEMMs run at a lower MFU live here, each as a physical quantity rather than a fitted share:

GEMMs (the linears, the LM head, the unfused attention's QK^T and AV) -- an additive roofline:
    t = 2 M N K / (peak x eta)  +  (M K + K N + M N) x bytes / (HBM bandwidth x MEMORY_EFFICIENCY)
  eta is the fitted share of the peak a training step's GEMMs reach (`hardware.CONSTANTS`); the second term is
  the operands and the output crossing HBM once, which a GEMM's tile pipeline hides only partly. A GEMM of
  arithmetic intensity I = FLOPs / bytes loses about ridge / I of its speed (ridge = peak x eta / bandwidth:
  ~150 FLOP/B on an A100, ~300 on an H100 SXM, ~380 on the 2.4 TB/s H100): ~10 % for the linears of the
  Megatron rows, 14-17 % for Llama 3 405B and 8B on H100s, 50 % for an 8B model split 8 ways (its GQA k and v
  projections are 128 columns wide) -- "larger GEMMs have higher arithmetic intensity and are consequently more
  efficient to execute" (Megatron-LM's README, its H100 weak-scaling table; Narayanan et al. 2021 Sec. 3.4:
  "increasing the microbatch size can also improve GPU utilization by increasing the arithmetic intensity").
  Per linear: one forward GEMM, two in the backward (input and weight gradients: the same three matrices).
Fused (flash) attention -- its own kernel efficiency, not the GEMMs': FlashAttention-2 reaches 99-189 TFLOPS
  forward + backward with a causal mask, head dimension 128, from 512 to 16k tokens on an A100 (Dao 2023,
  Fig. 4d), "up to 335" unmasked on an H100 (Fig. 7; ~35 % of its peak, Shah et al. 2024); PyTorch's SDPA still
  runs FlashAttention-2 there (pytorch/pytorch#142132: 329 TFLOPS vs cuDNN's 631 on H100). Modelled as
  eta_attn(s) = eta_inf x s / (s + ATTENTION_S0): the causal diagonal tiles and each query block's fixed work
  (load Q, rescale, write O) weigh more for short sequences (the A100 curve above gives s0 ~ 500). Only the
  unmasked half of the scores is computed; the backward does 2.5 forwards' worth (FA2 recomputes S).
Memory-bound kernels -- HBM bytes per token of every elementwise kernel (norms, rotary, activation, bias,
  dropout, residual, softmax, loss), as Megatron's fused kernels / Transformer Engine / torch.compile move them
  (`eager=False`) or as one eager PyTorch kernel per op (torchtitan without compile: RMSNorm in fp32 is six
  kernels, ~36 B per element instead of 4). The backward moves about twice the forward's bytes.
Not modelled: per-kernel launch latency (5-10 us; the published rows' kernels run 50 us and more), CPU-bound
  eager dispatch for tiny models. Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.parallel import comm

#: Linears whose INPUT dimension tensor parallelism splits (Megatron's RowParallelLinear); the others split
#: their output (ColumnParallelLinear).
ROW_PARALLEL = frozenset({"o_proj", "proj", "down_proj", "fc2"})
#: Sequence length at which a flash kernel reaches half its long-sequence efficiency (see the docstring).
ATTENTION_S0 = 512
#: One-way transfer times of a boundary activation on the critical path per micro-batch in DeepSpeed's pipeline
#: engine (blocking send/recv with both neighbours every step, chained; bench/pipeline_p2p_sim.py replays its
#: TrainSchedule: 4.0-4.4 for 4-35 stages, 2 for 2).
DEEPSPEED_P2P_EXPOSED = 4
#: FA2's backward runs 2.5 forwards' worth of matmuls (5 GEMMs to the forward's 2: it recomputes the scores).
ATTENTION_BACKWARD = 2.5


@dataclass(frozen=True)
class Rates:
    """What one GPU sustains: FLOP/s of the linears' GEMMs, of other GEMMs, of a flash kernel; bytes/s of HBM."""

    linear: float
    gemm: float
    attention: float
    hbm: float
    linear_bytes: float = 2.0
    """Bytes per operand element of the linears' GEMMs (1 for FP8 inputs)."""


def gemm_s(m: float, n: float, k: float, flops_rate: float, hbm: float, in_bytes: float = 2.0) -> float:
    """Seconds of an (m x k) @ (k x n) GEMM: FLOPs at the GEMM rate + operands and output through HBM once."""
    return 2 * m * n * k / flops_rate + (in_bytes * (m * k + k * n) + 2 * m * n) / hbm


def linear_shapes(spec, tok: int, tp: int, ep: int = 1) -> list[tuple[str, float, float, float, float]]:
    """(name, count, M, N, K) of the forward GEMMs of one layer on one GPU, `tok` tokens per micro-batch.

    Column-parallel linears split N by tp, row-parallel ones K. MoE (Mixtral): each of the E/ep local experts
    sees ep x tok x top_k / E tokens (its share of the routed copies of the ep ranks), 3 GEMMs each; the
    router is one (tok x h) @ (h x E)."""
    out = []
    for lin in spec.linears:
        n, k = (lin.fan_out, lin.fan_in / tp) if lin.name in ROW_PARALLEL else (lin.fan_out / tp, lin.fan_in)
        out.append((lin.name, 1, tok, n, k))
    a = spec.arch
    if a.get("experts"):
        e, h, inter = a["experts"], a["hidden"], a["intermediate"] / tp
        m_e = ep * tok * a["top_k"] / e
        local = e / ep
        out += [("gate_proj", local, m_e, inter, h), ("up_proj", local, m_e, inter, h),
                ("down_proj", local, m_e, h, inter), ("router", 1, tok, e, h)]
    return out


def linears_s(spec, tok: int, tp: int, rates: Rates, ep: int = 1, *, every_other: bool = False) -> float:
    """Forward seconds of one layer's linears (`every_other`: only the 2nd, 4th... in forward order, the
    matmuls torchtitan's per-op selective checkpointing recomputes)."""
    shapes = linear_shapes(spec, tok, tp, ep)
    if every_other:  # the attention and dense linears in forward order (experts are not nn.Linear modules)
        shapes = shapes[:len(spec.linears)][1::2]
    return sum(c * gemm_s(m, n, k, rates.linear, rates.hbm, rates.linear_bytes) for _, c, m, n, k in shapes)


def tp_blocks_s(spec, tok: int, tp: int, rates: Rates) -> list[tuple[float, float]]:
    """Forward seconds of each (column-parallel group, row-parallel linear) pair of a layer -- (q, k, v | o),
    (gate, up | down): the GEMMs a tensor-parallel all-gather feeds and a reduce-scatter drains."""
    blocks, col = [], 0.0
    for name, count, m, n, k in linear_shapes(spec, tok, tp)[:len(spec.linears)]:
        t = count * gemm_s(m, n, k, rates.linear, rates.hbm, rates.linear_bytes)
        if name in ROW_PARALLEL:
            blocks.append((col, t))
            col = 0.0
        else:
            col += t
    return blocks


def head_s(spec, tok: int, tp: int, rates: Rates) -> float:
    """Forward seconds of the vocab-parallel LM head GEMM (tok x h) @ (h x V/tp)."""
    a = spec.arch
    return gemm_s(tok, a["vocab"] / tp, a["hidden"], rates.gemm, rates.hbm)


def attention_s(spec, b: int, seq: int, q_seq: int, tp: int, rates: Rates, flash: bool) -> float:
    """Forward seconds of one layer's attention core for `b` sequences whose `q_seq` queries (seq / cp) each
    see `seq` keys. Flash: half the scores (causal) at the kernel's efficiency for the length ONE kernel call
    sees: `q_seq` -- under context parallelism the ring runs cp calls of seq / cp queries against seq / cp keys
    each (ring attention; Transformer Engine's CP), so the fixed work per query block and the causal diagonal
    weigh as at that length (eta(s / cp), not eta(s)). Unfused (Megatron 2021-22): QK^T and AV as per-head GEMMs
    over all s x s scores, the scores written and read through HBM."""
    a = spec.arch
    heads, hd = a["heads"] / tp, a["head_dim"]
    if flash:
        flops = 4 * b * q_seq * seq * heads * hd / 2
        return flops / (rates.attention * q_seq / (q_seq + ATTENTION_S0))
    batch = b * heads
    return batch * (gemm_s(q_seq, seq, hd, rates.gemm, rates.hbm) + gemm_s(q_seq, hd, seq, rates.gemm, rates.hbm))


def elementwise_bytes(spec, *, tp: int, sp: bool, seq: int, flash: bool, eager: bool) -> float:
    """HBM bytes per token and layer that the forward's memory-bound kernels move (bf16 activations),
    the unfused softmax's (`softmax_bytes`) included.

    Fused: each norm reads and writes the hidden state once (4 B per element), a residual add reads two and
    writes one (6), rotary reads and writes q and k (4), SwiGLU reads gate and up and writes their product (6
    per intermediate element), Megatron's bias-GeLU 4, bias-dropout-add 7 (a 1-byte mask). Eager PyTorch:
    RMSNorm upcasts to fp32 and runs cast, pow, mean, rsqrt-multiply, cast back and the weight multiply (~36 B),
    rotary goes through complex fp32 (~20), SwiGLU is silu then a multiply (10), the attention output is copied
    contiguous (4), Megatron's unfused bias, dropout and residual are three kernels (15). The unfused softmax
    path adds 9 B (fused scale-mask-softmax + dropout) or 17 B (eager) per score element. With sequence
    parallelism the norm-region kernels see 1/tp of the tokens."""
    a = spec.arch
    h, q, kv, inter = a["hidden"], a["heads"] * a["head_dim"] / tp, a["kv_heads"] * a["head_dim"] / tp, \
        a["intermediate"] / tp
    if a.get("experts"):
        inter *= a["top_k"]
    norm_share = 1 / tp if sp else 1.0
    if spec.kind == "gpt":  # LayerNorm, GeLU, biases, dropout
        region = (8 * h + (30 if eager else 14) * h) * norm_share
        per_token = region + (8 if eager else 4) * inter
    else:  # RMSNorm, rotary, SwiGLU
        region = ((72 if eager else 8) + 12) * h * norm_share
        per_token = region + (20 if eager else 4) * (q + kv) + (10 if eager else 6) * inter + (4 * q if eager else 0)
    return per_token + (0.0 if flash else softmax_bytes(spec, tp, seq, eager))


def softmax_bytes(spec, tp: int, seq: int, eager: bool) -> float:
    """HBM bytes per token and layer of the unfused attention core's elementwise kernels (forward): the
    scale-mask-softmax and the attention dropout over the token's heads x seq scores, 9 B per score fused
    (Megatron) or 17 B eager."""
    return (17 if eager else 9) * spec.arch["heads"] / tp * seq


def cp_merge_bytes(spec, tp: int, cp: int) -> float:
    """HBM bytes per token and layer (forward) of merging ring attention's partial results under context
    parallelism: each of the cp - 1 steps after the first writes its partial output (bf16, 2 B per element of
    the token's heads x head_dim / tp) and the merge reads it and reads and writes the running output in fp32
    (8 B), rescaled by the log-sum-exps (Liu et al. 2023; Transformer Engine's AttnFuncWithCPAndKVP2P corrects
    the output step by step). The backward accumulates dq (and dk, dv before they travel on) the same way: the
    model's 2x the forward's bytes. 0 without CP. Byte counts from the algorithm, not measured on a GPU."""
    if cp <= 1:
        return 0.0
    a = spec.arch
    return (cp - 1) * 10 * a["heads"] * a["head_dim"] / tp


def loss_bytes(spec, tp: int, eager: bool) -> float:
    """HBM bytes per token of the loss over the vocab-parallel logits, forward and backward: an eager fp32
    cross-entropy casts, log-softmaxes and backpropagates in fp32 (~28 B per logit), a fused one ~8."""
    return (28 if eager else 8) * spec.arch["vocab"] / tp


def fp8_cast_bytes(spec, tok: int, tp: int, fused: bool = False) -> tuple[float, float]:
    """(forward, backward) HBM bytes per token and layer of dynamic FP8 scaling (torchao's float8 linears):
    each linear's input and, in the backward, its output gradient are read in bf16 and written in fp8 twice
    (row- and column-major: Hopper's FP8 GEMMs need both layouts), 4 B per element; the weight the same once per
    micro-batch, spread over its `tok` tokens. `fused` (Transformer Engine: LayerNormLinear, the fused
    cast-transpose in the activation's epilogue): the kernel that produced the input writes the two fp8 copies,
    no separate bf16 read -- 2 B per element."""
    per = 2 if fused else 4
    fwd = bwd = 0.0
    for _, count, m, n, k in linear_shapes(spec, 1, tp):  # m: tokens this GEMM sees per token (MoE: top_k / E)
        fwd += count * (per * m * k + 4 * k * n / tok)
        bwd += count * per * m * n
    return fwd, bwd


def pp_cost(lay, act: float, gpus: int, gpus_per_node: int, nvlink: float, network: float
             ) -> tuple[float, float]:
    """(bytes sent, exposed seconds) of the pipeline's point-to-point traffic per micro-batch and GPU (`lay`: a
    perf_model.Layout).

    Each tensor-parallel rank sends 1/tp of the boundary activation (the receiving node all-gathers it on NVLink:
    Megatron's scatter/gather, Narayanan et al. 2021 Sec. 4.1; DeepSpeed's partitioned activations and
    gradients), once forward and once backward per model chunk (x interleave, Sec. 2.2.2). Megatron exchanges
    with one neighbour at a time (send_forward_recv_backward): both transfers are exposed. DeepSpeed's pipeline
    engine waits on blocking rendezvous with both neighbours every step, which chain through the pipeline:
    replaying its TrainSchedule, 4 one-way transfer times per micro-batch reach the critical path
    (`bench/pipeline_p2p_sim.py`), twice the two it sends."""
    if lay.pp == 1:
        return 0.0, 0.0
    crosses = gpus > gpus_per_node and lay.tp * lay.cp * lay.dp >= gpus_per_node  # stages tp*cp*dp ranks apart
    bw = network if crosses else nvlink
    sent = 2 * lay.interleave * comm.bytes_sent("send_recv", act / lay.tp, 2)
    exposed = DEEPSPEED_P2P_EXPOSED / 2 if lay.pipeline_engine == "deepspeed" else 1.0
    return sent, exposed * sent / bw


def cp_ep_bytes(spec, lay, tok: int, layers: int) -> tuple[float, float]:
    """Bytes one GPU sends per micro-batch for context and expert parallelism (bf16; `lay` a perf_model.Layout).

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


# ----------------------------------------------------------------------------- FLOPs, as the papers count them
def attention_flops(spec, seq: int) -> float:
    """Forward FLOPs per token of QK^T and AV (no causal halving, as the papers count)."""
    return 4 * seq * spec.arch["heads"] * spec.arch["head_dim"]


def linear_flops(spec, every_other: bool = False) -> float:
    """Forward FLOPs per token of the layer's linears (MoE: the k experts a token visits + the router);
    `every_other`: only the 2nd, 4th... linear in forward order (torchtitan's per-op recomputation)."""
    lins = spec.linears[1::2] if every_other else spec.linears
    gemms = 2 * sum(lin.fan_in * lin.fan_out for lin in lins)
    if spec.arch.get("experts") and not every_other:  # each token runs k SwiGLU experts (3 h x inter) + the router
        a = spec.arch
        gemms += 2 * (a["top_k"] * 3 * a["hidden"] * a["intermediate"] + a["experts"] * a["hidden"])
    return gemms


def layer_forward_flops(spec, seq: int) -> float:
    """Forward FLOPs of one layer per token: the GEMMs (from the spec's linears) + QK^T and AV."""
    return linear_flops(spec) + attention_flops(spec, seq)


def recompute_flops(spec, seq: int, checkpointing: str, flash: bool = False, policy: str = "core") -> float:
    """Forward FLOPs per token and layer that the backward redoes. Selective 'core': the attention core
    (Korthikanti Sec. 5) with the unfused softmax; a flash kernel's output is kept (nothing to redo). Selective
    'op' (torchtitan): every second matmul of the layer."""
    if checkpointing == "full":
        return layer_forward_flops(spec, seq)
    if checkpointing == "selective":
        if policy == "op":
            return linear_flops(spec, every_other=True)
        return 0.0 if flash else attention_flops(spec, seq)
    return 0.0


def step_flops(spec, tokens: int, seq: int, checkpointing: str, flash: bool = False,
               policy: str = "core") -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step of `tokens` tokens."""
    layers, logits = spec.arch["layers"], 2 * spec.arch["hidden"] * spec.arch["vocab"]
    model = 3 * tokens * (layers * layer_forward_flops(spec, seq) + logits)
    return model, model + tokens * layers * recompute_flops(spec, seq, checkpointing, flash, policy)
