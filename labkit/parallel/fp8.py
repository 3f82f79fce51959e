"""FP8 training: why every FP8 tensor carries a scale, and what FP8 saves in time and traffic.

Micikevicius et al. 2022 ("FP8 Formats for Deep Learning"): two 8-bit floats. E4M3 (torch.float8_e4m3fn,
max 448, 3 mantissa bits) for weights and activations, E5M2 (float8_e5m2, max 57344, 2 mantissa bits, a
wider range) for gradients. Their range is tiny next to bf16's (~1e38), so a tensor is cast as
`fp8(x * s)` with a per-tensor scale s = fp8_max / amax(x), and the GEMM multiplies the result by
1 / (s_a s_b). Without the scale, values below the smallest subnormal (2^-9 for E4M3) flush to zero --
gradients of 1e-5 all vanish -- and values above the max saturate.

Where the amax comes from:
- Transformer Engine (NVIDIA): its classic recipe, DelayedScaling (the default on Hopper), takes the scale of
  step t from the amax history of earlier steps (1024 steps, max), so the cast needs no extra pass over the
  tensor; a spike beyond the history saturates for a step. TE also has current (per-tensor, this step)
  scaling, and on Blackwell MXFP8 block scaling (one power-of-two scale per 32 values).
- torchao's float8 training (`convert_to_float8_training`, what torchtitan uses) uses DYNAMIC (current)
  scaling: the amax of this very tensor (one extra read), "tensorwise" (one scale per tensor) or
  "rowwise" (one per row: more accurate with outliers, slower GEMMs).
Both keep the master weights and the optimizer in fp32/bf16: FP8 is the GEMM inputs only, so model-state
memory does not change; what changes is GEMM speed (2x the bf16 peak on H100) minus the cast traffic
(`labkit.parallel.perf_ops.fp8_cast_bytes`, which the planner charges).

FSDP2 + float8 (torchao `enable_fsdp_float8_all_gather=True`): the weights are cast to fp8 BEFORE the
all-gather, so each all-gather moves 1 byte per parameter instead of bf16's 2 (the bytes from
`labkit.parallel.comm`), and the amaxes of all shards are reduced in one all-reduce
(`precompute_float8_dynamic_scale_for_fsdp`). Needs FP8 tensor cores (H100/H200/B200, sm_89+); run on CPU,
this module shows the numerics only. Introduced in notebook 08_profiling_and_stacking.
"""
from __future__ import annotations

import torch

from labkit.errors import ConfigError, choices_error
from labkit.parallel import comm

#: format -> (torch dtype, what it carries in training)
FORMATS = {"e4m3": (torch.float8_e4m3fn, "weights and activations (forward)"),
           "e5m2": (torch.float8_e5m2, "gradients (backward)")}
SCALINGS = ("none", "tensorwise", "rowwise")


def fp8_max(fmt: str) -> float:
    """Largest finite value of the format (448 for e4m3, 57344 for e5m2)."""
    if fmt not in FORMATS:
        raise choices_error("fp8 format", fmt, list(FORMATS))
    return float(torch.finfo(FORMATS[fmt][0]).max)


def scale(x: torch.Tensor, fmt: str, scaling: str = "tensorwise") -> torch.Tensor:
    """The multiplier s with fp8(x * s) filling the format: fp8_max / amax (torchao's dynamic scaling);
    a (rows, 1) column for 'rowwise', 1 for 'none'. In fp32; an all-zero tensor gets scale 1."""
    if scaling not in SCALINGS:
        raise choices_error("fp8 scaling", scaling, list(SCALINGS))
    if scaling == "none":
        return torch.ones((), dtype=torch.float32)
    amax = x.detach().abs().float().amax() if scaling == "tensorwise" else x.detach().abs().float().amax(-1, keepdim=True)
    return torch.where(amax > 0, fp8_max(fmt) / amax.clamp(min=1e-30), torch.ones_like(amax))


def roundtrip(x: torch.Tensor, fmt: str, scaling: str = "tensorwise") -> torch.Tensor:
    """x cast to fp8 with its scale and back (what the GEMM sees, times 1/s): saturating, like torchao."""
    if x.dim() < 2 and scaling == "rowwise":
        raise ConfigError(f"rowwise scaling needs a matrix; got a tensor of shape {tuple(x.shape)}: use tensorwise")
    s = scale(x, fmt, scaling)
    m = fp8_max(fmt)
    q = (x.float() * s).clamp(-m, m).to(FORMATS[fmt][0])
    return q.float() / s


def error(x: torch.Tensor, fmt: str, scaling: str = "tensorwise") -> dict:
    """How much of x survives the cast: relative error (L2), and the share of nonzeros flushed to zero."""
    y = roundtrip(x, fmt, scaling)
    nonzero = x != 0
    return {"format": fmt, "scaling": scaling,
            "rel_error": float((y - x.float()).norm() / x.float().norm().clamp(min=1e-30)),
            "flushed_to_zero": float(((y == 0) & nonzero).sum() / nonzero.sum().clamp(min=1))}


def allgather_bytes(params: int, world: int, dtype: str) -> float:
    """Bytes one rank sends to all-gather `params` parameters stored as `dtype` ('fp8', 'bf16', 'fp32')."""
    size = {"fp8": 1, "bf16": 2, "fp32": 4}
    if dtype not in size:
        raise choices_error("all-gather dtype", dtype, list(size))
    return comm.bytes_sent("all_gather", params * size[dtype], world)


def fp8_linear_filter(module, fqn: str) -> bool:
    """Which Linears torchao converts: both dims multiples of 16 (what the FP8 GEMM `torch._scaled_mm` needs)."""
    return isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def compare_training(device, *, width: int = 64, depth: int = 2, steps: int = 3, batch: int = 64,
                     lr: float = 1e-3, seed: int = 0) -> dict:
    """Train the same MLP (`depth` blocks Linear(width, 4 width) -> GELU -> Linear(4 width, width), residual)
    `steps` steps twice on the same batches towards a fixed random target: in high precision (fp32 on CPU,
    bf16 autocast on a GPU) and with torchao's float8 linears (`convert_to_float8_training`: dynamic
    tensorwise scaling, e4m3 forward, e5m2 gradients). Returns both loss curves and how many Linears run in FP8.

    On CPU torch's `_scaled_mm` computes the FP8 GEMMs in software (numerics only, slowly: kept tiny); on an
    H100 (notebook 08 on h100x1) the same code runs them on the FP8 tensor cores -- unverified on hardware
    here, and torchao's speed-up needs torch.compile to fuse the casts (not done: this shows the numerics)."""
    import contextlib

    from torchao.float8 import convert_to_float8_training

    from labkit.runtime import device as devices

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

        def forward(self, x):  # (batch, width)
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    g = torch.Generator().manual_seed(seed)
    data = [torch.randn(batch, width, generator=g) for _ in range(steps)]
    target = torch.randn(width, width, generator=g) / width ** 0.5
    out = {}
    for name in ("high precision", "fp8"):
        torch.manual_seed(seed)
        net = devices.place(torch.nn.Sequential(*(Block() for _ in range(depth))), device)
        if name == "fp8":
            convert_to_float8_training(net, module_filter_fn=fp8_linear_filter)
        out[f"{name} linears"] = sum(type(m).__name__ == ("Float8Linear" if name == "fp8" else "Linear")
                                     for m in net.modules())
        opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
        losses = []
        for x in data:
            x = x.to(device)
            with devices.autocast(device, torch.bfloat16) if devices.is_gpu(device) else contextlib.nullcontext():
                loss = (net(x).float() - x @ target.to(device)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        out[name] = losses
    return out
