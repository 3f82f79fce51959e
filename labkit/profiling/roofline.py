"""The roofline: which operators of a transformer layer are limited by FLOPs and which by bytes.

Williams, Waterman & Patterson 2009: an operator that does F FLOPs and moves B bytes to and from memory has
arithmetic intensity I = F / B (FLOP/byte). On a device with peak P FLOP/s and memory bandwidth W B/s it
can reach at most min(P, I x W): below the RIDGE point I* = P / W it is memory-bound (the bytes set its
time), above it compute-bound. An A100 (312 TFLOPS bf16, 2.0 TB/s) has I* ~ 153 FLOP/B, an H100 SXM
(989, 3.35) ~ 295: a GEMM (m x k) @ (k x n) has I = 2mnk / (2(mk + kn + mn)) ~ m for square-ish shapes,
hundreds to thousands with thousands of tokens; a softmax, a norm, an activation or a residual add does
a few FLOPs per element it reads and writes (I ~ 1): memory-bound by two orders of magnitude, which is why
they are fused (FlashAttention keeps the scores in SRAM; torch.compile fuses the elementwise chains).

MFU vs HFU (Chowdhery et al. 2022, PaLM, App. B; Korthikanti et al. 2022): MFU counts the model's FLOPs
(6 N D plus attention) against the peak; HFU counts what the hardware ran, recomputation included. Full
activation checkpointing redoes the forward: 8 N D instead of 6 N D, HFU = 4/3 MFU for the same step.
The FLOP counts are `labkit.parallel.perf_ops`'s (the planner's); this module only divides them by bytes.
Introduced in notebook 08_profiling_and_stacking.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from labkit.errors import choices_error
from labkit.parallel import perf_ops
from labkit.parallel.hardware import GPUS

#: (FLOPs, bytes moved) per element of the memory-bound operators, bf16 in and out, one fused kernel each:
#: softmax reads and writes the score (exp, sum, max, divide: ~5 FLOPs); RMSNorm reads and writes the hidden
#: state (square, sum, rsqrt, two multiplies: ~4); SwiGLU reads gate and up, writes their product (silu ~4 + 1);
#: the residual add reads two and writes one (1 FLOP).
ELEMENTWISE = {"softmax": (5, 4), "rms_norm": (4, 4), "swiglu": (5, 6), "residual_add": (1, 6)}


@dataclass(frozen=True)
class Op:
    """One operator of a forward pass: its FLOPs, the bytes it moves through memory, their ratio."""

    name: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """FLOP per byte."""
        return self.flops / self.bytes


def ridge(gpu: str, precision: str = "bf16") -> float:
    """FLOP/byte at which `gpu`'s roofline bends: its dense peak over its HBM bandwidth (data sheets)."""
    if gpu not in GPUS:
        raise choices_error("gpu", gpu, sorted(GPUS))
    g = GPUS[gpu]
    peak = g.fp8_tflops if precision == "fp8" and g.fp8_tflops else g.peak_tflops
    return peak * 1e12 / (g.hbm_gbs * 1e9)


def attainable(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline: FLOP/s an operator of this intensity can reach at most."""
    return min(peak_flops, intensity * bandwidth)


def layer_ops(model: str, *, batch: int, seq: int, elem_bytes: int = 2) -> list[Op]:
    """The forward operators of one decoder layer of `model` for `batch` sequences of `seq` tokens, unfused
    attention (scores materialised), one GPU: the linears' GEMMs, QK^T and AV, and the memory-bound rest."""
    from labkit.memory.params import model_spec

    spec = model_spec(model)
    a, tok = spec.arch, batch * seq
    ops = [Op(name, 2 * c * m * n * k, elem_bytes * c * (m * k + k * n + m * n))
           for name, c, m, n, k in perf_ops.linear_shapes(spec, tok, 1)]
    heads, hd = a["heads"], a["head_dim"]
    scores = batch * heads * seq * seq  # elements of the (B, h, T, T) score tensor
    ops.append(Op("q @ k^T", 2 * scores * hd, elem_bytes * batch * heads * (2 * seq * hd + seq * seq)))
    ops.append(Op("scores @ v", 2 * scores * hd, elem_bytes * batch * heads * (seq * seq + 2 * seq * hd)))
    sizes = {"softmax": scores, "rms_norm": 2 * tok * a["hidden"], "swiglu": tok * a["intermediate"],
             "residual_add": 2 * tok * a["hidden"]}
    for name, elements in sizes.items():
        flops, nbytes = ELEMENTWISE[name]
        ops.append(Op(name, flops * elements, nbytes * elements * elem_bytes / 2))
    return ops


def table(model: str, gpu: str, *, batch: int, seq: int) -> list[dict]:
    """`layer_ops` on `gpu`'s roofline: intensity, the bound, the share of the peak it can reach at most."""
    g, knee = GPUS[gpu], ridge(gpu)
    rows = []
    for op in layer_ops(model, batch=batch, seq=seq):
        reach = attainable(op.intensity, g.peak_tflops * 1e12, g.hbm_gbs * 1e9) / (g.peak_tflops * 1e12)
        rows.append({"op": op.name, "GFLOP": op.flops / 1e9, "MB": op.bytes / 1e6, "FLOP/B": op.intensity,
                     "bound": "compute" if op.intensity >= knee else "memory", "max_share_of_peak": reach})
    return rows


def mfu_hfu(model: str, *, tokens: int, seq: int, step_s: float, gpus: int, peak_tflops: float,
            checkpointing: str = "none") -> tuple[float, float]:
    """(MFU, HFU) of a step of `tokens` tokens that took `step_s` seconds on `gpus` GPUs of `peak_tflops`:
    the model's FLOPs and the hardware's (recomputation included) over the peak."""
    from labkit.memory.params import model_spec

    model_flops, hardware_flops = perf_ops.step_flops(model_spec(model), tokens, seq, checkpointing)
    peak = gpus * peak_tflops * 1e12 * step_s
    return model_flops / peak, hardware_flops / peak


def measure(fn, flops: float, nbytes: float, *, repeats: int = 5) -> dict:
    """Run `fn()` `repeats` times; the best time and the FLOP/s and bytes/s it reached (this machine's point
    on its own roofline: a CPU core here, a GPU kernel on a node -- call torch.cuda.synchronize inside fn)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return {"seconds": best, "flops_per_s": flops / best, "bytes_per_s": nbytes / best,
            "intensity": flops / nbytes}
