"""The GPUs and node fabrics the planner knows, and the few fitted constants of its time model.

Pure Python, no torch. A `GpuSpec` is a data sheet: memory, dense tensor-core peaks (bf16; fp8 where the
GPU has it), NVLink bandwidth inside a node, HBM bandwidth, and the inter-node bandwidth PER GPU of the
systems it is sold in (DGX A100: one 200 Gb/s HDR NIC per GPU; DGX/HGX H100, H200, B200: one 400 Gb/s
NDR NIC per GPU). A run on another fabric states its own (`inter_node_gbps`, `labkit plan
--inter-node-gbps`): BLOOM's Jean Zay nodes had 4 x 100 Gb/s Omni-Path for 8 GPUs, 50 Gb/s per GPU.

The time model's constants, each with a physical meaning (`CONSTANTS`, fitted by
`labkit.parallel.calibration` on the rows of `labkit/data/published_runs.json` marked calibration):
  matmul efficiency  share of the dense peak the GEMMs' arithmetic reaches, per GPU family, once the roofline
                     has charged their HBM traffic (`labkit.parallel.perf_ops`); fitted 0.80 (A100) and 0.82
                     (H100), beside the best-shape torch.mm ceilings measured independently (MAMF: 0.87, 0.80);
  comm efficiency    achieved NCCL bus bandwidth / NVLink's data-sheet bandwidth, for the TP all-reduces and
                     DP collectives inside a node (the network's, 0.9 of the NICs' line rate as nccl-tests
                     reach on InfiniBand, is a stated assumption: few calibration rows depend on it);
  overlap efficiency share of the shorter of a layer's compute and its data-parallel collectives that really
                     runs concurrently (NCCL's kernels take SMs and HBM bandwidth from the GEMMs).
Everything else is stated, not fitted: HBM efficiency, flash-attention kernel efficiency (FlashAttention-2's
published curves), FP8 and B200 matmul efficiency (from the MAMF ceilings), T4's (an assumption), the
power-capped H100's peak (an interpolation). A node's own measurement (`labkit preflight`) is used only when the caller
passes it (`matmul_efficiency(..., measured=path)`): a measurement written to a shared cache must not
silently change everybody's plan (issue 25, finding 7).
Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
from dataclasses import dataclass
from pathlib import Path

from labkit.errors import ConfigError, choices_error


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: memory, peaks and the bandwidths the time model uses (per GPU, per direction)."""

    memory_gb: float
    """HBM in GB (10^9 B), as the profiles count it."""
    peak_tflops: float
    """Dense bf16 (V100: fp16) tensor-core peak."""
    nvlink_gbs: float
    """NVLink bandwidth inside a node, GB/s per direction."""
    inter_node_gbps: float
    """Inter-node bandwidth per GPU in Gb/s (one NIC per GPU in the DGX/HGX designs)."""
    hbm_gbs: float = 2039.0
    """HBM bandwidth, GB/s (data sheet)."""
    fp8_tflops: float = 0.0
    """Dense FP8 tensor-core peak; 0 = no FP8 tensor cores."""


#: Data sheets (dense peaks; NVLink per direction): A100 SXM 312 TFLOPS, NVLink3 600 GB/s bidirectional, HBM2e
#: 2039 GB/s (80GB) / 1555 (40GB), DGX A100 8 x HDR 200 Gb/s; H100 SXM 989 bf16 / 1979 fp8, NVLink4 900 GB/s,
#: HBM3 3350 GB/s, DGX H100 8 x NDR 400 Gb/s; H200 the H100's compute with 141 GB HBM3e at 4800 GB/s; B200
#: (HGX/DGX B200) 2250 bf16 / 4500 fp8 dense, 180 GB HBM3e 8000 GB/s, NVLink5 1800 GB/s, 8 x 400 Gb/s;
#: V100 SXM2 125 fp16, NVLink2 300 GB/s, HBM2 900 GB/s, EDR 100 Gb/s; T4 (Colab's, Kaggle's) 65 fp16, 16 GB GDDR6
#: at 320 GB/s, no NVLink: PCIe Gen3 x16, 16 GB/s per direction, between the GPUs of a node; 25 Gb/s Ethernet
#: between hosts (an assumption: T4 clouds do not publish a training fabric). `h100-96gb`: the H100 SXM with 96 GB
#: HBM2e at 2.4 TB/s run at a 500 W power limit (Meta's Grand Teton), that torchtitan's published benchmarks ran
#: on. Its peak is "between SXM and NVL, and we don't know its exact value" (torchtitan): a tensor core's peak is
#: its clock, and the clock a GPU holds is set by its power limit, so we interpolate the data sheets' dense bf16
#: peaks linearly in board power between the H100 NVL (835 TFLOPS at 400 W) and the H100 SXM (989 at 700 W):
#: 886 TFLOPS at 500 W (fp8 x2). A stated assumption, not a measurement; its MFU is quoted against 886.
GPUS = {
    "a100-80gb": GpuSpec(80.0, 312.0, 300.0, 200.0, 2039.0),
    "a100-40gb": GpuSpec(40.0, 312.0, 300.0, 200.0, 1555.0),
    "h100-sxm": GpuSpec(80.0, 989.0, 450.0, 400.0, 3350.0, fp8_tflops=1979.0),
    "h100-96gb": GpuSpec(96.0, 886.0, 450.0, 400.0, 2400.0, fp8_tflops=1772.0),
    "h200": GpuSpec(141.0, 989.0, 450.0, 400.0, 4800.0, fp8_tflops=1979.0),
    "b200": GpuSpec(180.0, 2250.0, 900.0, 400.0, 8000.0, fp8_tflops=4500.0),
    "v100-32gb": GpuSpec(32.0, 125.0, 150.0, 100.0, 900.0),
    "t4-16gb": GpuSpec(16.0, 65.0, 16.0, 25.0, 320.0),
}
#: Older names that mean the same card (kept as keys too: `labkit preflight` and old notebooks index GPUS by them).
ALIASES = {"h100-80gb": "h100-sxm"}
GPUS.update({old: GPUS[new] for old, new in ALIASES.items()})
PRECISIONS = ("bf16", "fp16", "fp8")


def gpu_spec(name: str) -> GpuSpec:
    """The spec of a GPU name (or alias); ConfigError listing the valid names otherwise."""
    name = ALIASES.get(name, name)
    if name not in GPUS:
        raise choices_error("gpu", name, list(GPUS) + list(ALIASES))
    return GPUS[name]


def canonical(name: str) -> str:
    gpu_spec(name)
    return ALIASES.get(name, name)


def gpu_family(gpu: str) -> str:
    return canonical(gpu).split("-")[0]


def default_precision(gpu: str) -> str:
    return "fp16" if gpu_family(gpu) in ("v100", "t4") else "bf16"


#: Share of the HBM data-sheet bandwidth fused elementwise kernels reach (assumption: copy kernels reach
#: ~80-90 %; norms and softmax a little less). Not fitted.
MEMORY_EFFICIENCY = 0.8
#: Bytes the optimizer step reads and writes per parameter it updates (Adam, mixed precision: fp32 master,
#: m, v and gradient read, three written back, bf16 weight written).
OPTIMIZER_BYTES = 32
#: The same with Adam's moments kept in bf16 (`--optimizer-states bf16`: Megatron-Core's precision-aware
#: optimizer, NeMo's large recipes): m and v read and written in 2 B each instead of 4.
OPTIMIZER_STATES = ("fp32", "bf16")


def optimizer_bytes(states: str = "fp32") -> int:
    """HBM bytes the Adam step moves per parameter it updates (`OPTIMIZER_BYTES`, 8 fewer with bf16 moments)."""
    if states not in OPTIMIZER_STATES:
        raise choices_error("optimizer_states", states, OPTIMIZER_STATES)
    return OPTIMIZER_BYTES - (8 if states == "bf16" else 0)


#: Software stacks (`Layout.stack`, `labkit plan --stack`): which kernels run a step.
#:   megatron       Megatron-Core / NeMo with Transformer Engine (and Meta's Llama 3 stack): fused norm, SwiGLU and
#:                  bias-dropout-add kernels, TE's GEMMs with fused casts -- what the calibration rows ran
#:   torch-compile  torch-native (torchtitan, FSDP scripts, llm-foundry) under torch.compile: fused elementwise
#:                  kernels; the linears are nn.Linear GEMMs through cuBLAS, one launch per op
#:   eager          torch-native without compile: one kernel per elementwise op (`perf_ops.elementwise_bytes`)
#: A torch-native step's linears reach `stack_efficiency` of the fused stack's GEMM rate on a GPU family: what
#: the model does not itemize (nn.Linear's cuBLAS heuristics against TE's tuned GEMMs, per-op launches, the casts
#: and transposes TE fuses into its GEMMs' neighbours). Fitted per family like the matmul efficiency, on the
#: torch-native calibration rows (H100: torchtitan's single-node 8B runs); a family without such rows keeps the
#: fused stack's rate (1.0), stated in the plan.
STACKS = ("megatron", "torch-compile", "eager")


def stack_efficiency(gpu: str, stack: str = "megatron") -> float:
    """Share of the fused stack's GEMM rate `stack`'s linears reach on `gpu` (1.0 for megatron; H200 = H100)."""
    if stack not in STACKS:
        raise choices_error("stack", stack, STACKS)
    fam = gpu_family(gpu)
    return 1.0 if stack == "megatron" else CONSTANTS.get(f"stack_efficiency.{ {'h200': 'h100'}.get(fam, fam) }", 1.0)
#: Attention kernels (`Layout.attention`, `labkit plan --attention`) as a multiple of FlashAttention-2's rate
#: (`ATTENTION_EFFICIENCY`): 'sdpa' is PyTorch's scaled_dot_product_attention, which runs FA2 on A100/H100
#: (pytorch/pytorch#142132) and its memory-efficient kernel on V100/T4 (no FA2 there: ATTENTION_EFFICIENCY's
#: V100/T4 entries are that kernel's); 'fa3' is FlashAttention-3 or cuDNN's fused attention on Hopper and later,
#: "1.5-2.0x faster than FlashAttention-2" in BF16 (Shah et al. 2024, abstract): 1.75; 'triton' is the Triton
#: flash-attention kernel of 2022-23 (MosaicML's MPT), which FlashAttention-2 beats "1.3-2.5x" (Dao 2023,
#: Sec. 4.1): 1 / 1.8; 'eager' is the unfused path (QK^T, softmax, AV through HBM: `perf_ops.attention_s`).
ATTENTION_KERNELS = {"fa2": 1.0, "sdpa": 1.0, "fa3": 1.75, "triton": 1 / 1.8, "eager": 0.0}
#: Kernels a GPU family cannot run (FA2 needs sm80+, FA3 / cuDNN fused attention sm90+).
ATTENTION_NEEDS = {"fa2": ("a100", "h100", "h200", "b200"), "fa3": ("h100", "h200", "b200")}
#: Maximum achievable matmul FLOPS: the best torch.mm rate a brute-force search over shapes finds, as a share of
#: the dense data-sheet peak (S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md, "Maximum
#: Achievable Matmul FLOPS comparison table"): A100 SXM 271.2/312 bf16; H100 SXM 794.5/989 bf16 ("H200 is the
#: same"), 1402.6/1979 fp8; H200 1453.4/1979 fp8; B200 1745.0/2250 bf16, 3432.5/4500 fp8. Used for what no
#: published row fits: the FP8 GEMMs reach the same share of THEIR ceiling as the bf16 ones
#: (`default_efficiency`), and a GPU family without rows reaches its ceiling times the fitted families' mean share.
MAMF = {("a100", "bf16"): 0.869, ("h100", "bf16"): 0.803, ("h100", "fp8"): 0.709, ("h200", "bf16"): 0.803,
        ("h200", "fp8"): 0.734, ("b200", "bf16"): 0.776, ("b200", "fp8"): 0.763}


#: Fused (flash) attention kernels, forward + backward, long-sequence share of the dense bf16 peak
#: (`labkit.parallel.perf_ops`: eta(s) = eta_inf s / (s + 512)). A100: FlashAttention-2 with a causal mask and
#: head dimension 128 reaches 99-189 TFLOPS from 512 to 16k tokens (Dao 2023, Fig. 4d), 0.62 x 312 x s/(s+512);
#: without the mask 203 at most (Fig. 4b). H100/H200: FA2, which PyTorch's SDPA (and so torchtitan) runs there,
#: reaches "up to 335 TFLOPs/s" forward + backward (Dao 2023, Fig. 7: no mask), x 189/203 for the causal mask:
#: 0.32 x 989 at long sequences ("35 %" of the peak: Shah et al. 2024, FlashAttention-3, which -- like cuDNN --
#: would roughly double it: pytorch/pytorch#142132). B200, V100: assumptions (no published row).
ATTENTION_EFFICIENCY = {"a100": 0.62, "h100": 0.32, "b200": 0.35, "v100": 0.3, "t4": 0.3}


def default_attention(gpu: str) -> str:
    """FlashAttention-2 where it runs (A100 and later), else PyTorch's SDPA (its memory-efficient kernel)."""
    return "fa2" if gpu_family(gpu) in ATTENTION_NEEDS["fa2"] else "sdpa"


def attention_efficiency(gpu: str, kernel: str = "fa2") -> float:
    """Long-sequence share of the bf16 peak the `kernel` attention reaches on `gpu` (H200 = H100's dies);
    ConfigError if the GPU cannot run it (`ATTENTION_NEEDS`)."""
    fam = gpu_family(gpu)
    if kernel not in ATTENTION_KERNELS:
        raise choices_error("attention", kernel, ATTENTION_KERNELS)
    if fam not in ATTENTION_NEEDS.get(kernel, (fam,)):
        raise ConfigError(f"attention {kernel} on {gpu}: the kernel needs {'/'.join(ATTENTION_NEEDS[kernel])} "
                          "GPUs; use sdpa (PyTorch's, which picks what the GPU has) or eager")
    return ATTENTION_EFFICIENCY[{"h200": "h100"}.get(fam, fam)] * (ATTENTION_KERNELS[kernel] or 1.0)


@dataclass(frozen=True)
class Efficiency:
    """Achievable share of the dense tensor-core peak for the model's GEMMs, and where it came from."""

    value: float
    source: str


#: The fitted constants (`labkit.parallel.calibration.fit` reproduces them from the calibration rows; a test
#: holds this table to the fit). Physical meaning in the module docstring.
CONSTANTS = {
    "matmul_efficiency.a100": 0.804,
    "matmul_efficiency.h100": 0.822,
    "matmul_efficiency.v100": 0.984,
    "comm_efficiency.nvlink": 0.673,
    "comm_efficiency.network": 0.9,
    "overlap_efficiency": 0.703,
    "stack_efficiency.h100": 0.748,
}
#: Assumed where neither a calibration row nor a MAMF measurement exists (stated in every plan's source line).
#: T4: a 70 W card whose clocks drop under sustained tensor-core load; half its 65 TFLOPS data-sheet peak.
#: (V100 is fitted since issue 42, on Megatron-LM v1.0's 1.2B baseline: 0.984 -- near 1 because the additive
#: roofline charges V100's 900 GB/s HBM in full, where its GEMM kernels overlap much of it, and the DGX-2H's
#: 450 W V100s peak ~4 % above the 125 TFLOPS modelled; its 4.2B TP-4 row, held out, comes out -2 %.)
ASSUMED_EFFICIENCY = {"t4": 0.5}


def comm_efficiency(link: str = "nvlink") -> float:
    """NCCL bus bandwidth over the link's data sheet, inside a node (`nvlink`: nccl-tests report ~230 of
    300 GB/s on DGX A100) or between nodes (`network`: the NICs' line rate)."""
    return CONSTANTS[f"comm_efficiency.{link}"]


def _fitted(fam: str) -> float | None:
    return CONSTANTS.get(f"matmul_efficiency.{ {'h200': 'h100'}.get(fam, fam) }")


def default_efficiency(gpu: str, precision: str = "bf16") -> Efficiency:
    """The planner's matmul efficiency for `gpu`: fitted (A100, H100; H200 shares the H100's compute dies), or
    for a family without rows its MAMF ceiling x the fitted families' mean share of theirs (B200), or a stated
    assumption (V100). FP8: the bf16 value x MAMF fp8 / MAMF bf16 (the same share of a lower ceiling)."""
    fam = gpu_family(gpu)
    if precision not in PRECISIONS:
        raise choices_error("precision", precision, PRECISIONS)
    if precision == "fp8" and not gpu_spec(gpu).fp8_tflops:
        raise ConfigError(f"precision fp8 on {gpu}: it has no FP8 tensor cores; use bf16, or an h100-sxm, "
                          "h200 or b200")
    fitted = _fitted(fam)
    if fitted is not None:
        value, source = fitted, (f"{fam.upper()} efficiency fitted to the calibration rows of "
                                 "labkit/data/published_runs.json, labkit.parallel.calibration")
    elif (fam, "bf16") in MAMF:
        shares = [CONSTANTS[k] / MAMF[(k.split(".")[1], "bf16")] for k in CONSTANTS
                  if k.startswith("matmul_") and (k.split(".")[1], "bf16") in MAMF]
        value = MAMF[(fam, "bf16")] * sum(shares) / len(shares)
        source = (f"{fam.upper()} has no published row: its measured matmul ceiling, MAMF {MAMF[(fam, 'bf16')]:.0%} "
                  "of peak, x the share of theirs the fitted GPUs reach, labkit.parallel.hardware.MAMF")
    else:
        value, source = ASSUMED_EFFICIENCY[fam], f"{fam.upper()} {precision} efficiency: an assumption, no published row"
    if precision == "fp8":
        ratio = MAMF[(fam, "fp8")] / MAMF[(fam, "bf16")]
        return Efficiency(round(value * ratio, 4), f"FP8 linears: {source}; x {ratio:.2f}, MAMF fp8 / bf16")
    return Efficiency(value, source)


#: Where `labkit preflight` writes the node's measured matmul efficiency (format: `read_perf_file`). The planner
#: reads it only when asked (`--measured FILE`, `PlanRequest(measured=...)`).
PERF_FILE_NAME = "matmul_efficiency.json"
PERF_FILE_ENV = "LABKIT_MATMUL_FILE"


def read_perf_file(path: Path, gpu: str, precision: str) -> Efficiency | None:
    """The measured efficiency for `gpu` and `precision` in a perf file, or None if it has none.

    Format (JSON): {"measurements": [{"gpu": "a100-80gb", "precision": "bf16", "efficiency": 0.78,
    "tflops": 243.4, "tool": "labkit preflight", "measured_at": "2026-11-25T01:00:00Z"}, ...]}."""
    try:
        rows = json.loads(Path(path).read_text())["measurements"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read matmul measurements from {path}: {exc}; rerun `labkit preflight` "
                          f"or give another file (format: labkit.parallel.hardware.read_perf_file)") from None
    gpu = canonical(gpu)
    for row in rows:
        if canonical(row.get("gpu", gpu)) == gpu and row.get("precision", "bf16") == precision:
            value = row.get("efficiency")
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ConfigError(f"{path}: efficiency={value!r} for {gpu}; it must be in (0, 1]")
            return Efficiency(float(value), f"measured on a node by {row.get('tool', 'a measurement')} ({path})")
    return None


def record_measurement(gpu: str, precision: str, tflops: float, *, tool: str, path: Path | None = None) -> Path:
    """Add (or replace) a node's measured matmul efficiency (tflops / the GPU's peak) in a perf file.

    `path` defaults to $LABKIT_MATMUL_FILE, else matmul_efficiency.json in labkit's cache folder; the planner
    never reads it on its own (pass it as `measured=`)."""
    from labkit.zoo.cache import cache_root

    spec = gpu_spec(gpu)
    path = Path(path or os.environ.get(PERF_FILE_ENV) or cache_root() / PERF_FILE_NAME).expanduser()
    rows = []
    if path.exists():
        try:
            rows = json.loads(path.read_text())["measurements"]
        except (OSError, ValueError, KeyError, TypeError):
            rows = []  # an unreadable file is replaced by this measurement
    row = {"gpu": canonical(gpu), "precision": precision,
           "efficiency": round(min(1.0, tflops / spec.peak_tflops), 4), "tflops": round(tflops, 2), "tool": tool,
           "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    rows = [r for r in rows if not (canonical(r.get("gpu", gpu)) == row["gpu"]
                                    and r.get("precision", "bf16") == precision)] + [row]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"measurements": rows}, indent=1))
    tmp.replace(path)
    return path


def matmul_efficiency(gpu: str, precision: str = "bf16", *, override: float | None = None,
                      measured: Path | str | None = None) -> Efficiency:
    """The efficiency to plan with: `override` > a measurement file the caller names > the fitted default.

    No file is read unless `measured` names it: plans (and graded answers recomputed from them) do not shift
    because somebody ran a preflight on the same machine."""
    if override is not None:
        if not 0 < override <= 1:
            raise ConfigError(f"matmul_efficiency={override!r}; it must be in (0, 1], e.g. 0.8")
        return Efficiency(float(override), "given by the caller (matmul_efficiency)")
    if measured is not None:
        found = read_perf_file(Path(measured).expanduser(), gpu, precision)
        if found is None:
            raise ConfigError(f"{measured} has no measurement for {canonical(gpu)} {precision}; run `labkit "
                              "preflight` on that GPU, or plan without --measured (the fitted default)")
        return found
    return default_efficiency(gpu, precision)
