"""Named run profiles: one frozen dataclass per machine the course runs on.

`smoke` is what CI, tests and GPU-less learners run (CPU, gloo, tiny models, 2 ranks, seconds per
run); the GPU profiles use the same code paths with real models. Precedence: dataclass defaults <
profile function < CLI / papermill parameters, applied with `get_profile(name, **overrides)`.
Introduced in notebook 00_setup.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from labkit.errors import ConfigError, choices_error

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Profile:
    """Everything a lab needs to know about the machine it runs on."""

    name: str
    """Profile name, e.g. 'smoke' or 'a100x4'."""
    device: str
    """'cpu' or 'cuda'."""
    backend: str
    """torch.distributed backend: 'gloo' on CPU, 'nccl' on GPUs."""
    nproc: int
    """Ranks per node for multi-process labs (GPUs per node; 2 in smoke)."""
    dtype: str
    """Compute dtype for mixed precision: 'float32', 'bfloat16' or 'float16' (V100 has no bf16)."""
    llm_model: str
    """LLM preset or local checkpoint path used by the LLM labs (04-08)."""
    vision_model: str
    """Vision preset used by the ResNet labs (02-03)."""
    image_batch: int
    """GLOBAL batch size for the vision labs (split over data-parallel ranks)."""
    llm_batch: int
    """GLOBAL batch size (sequences) for the LLM labs."""
    seq_len: int
    """Tokens per LLM training sequence."""
    image_size: int
    """Square image side in pixels for the vision labs."""
    steps: int
    """Default optimizer steps per run."""
    lr: float
    """Default learning rate (AdamW) for a global batch of this profile's size."""
    timeout_s: float
    """Wall-clock limit for one launched run before all ranks are stopped (a whole run: an hour on a node)."""
    collective_timeout_s: float = 600.0
    """How long one collective may wait for its peers before the process group fails it (torch's
    `init_process_group(timeout=)`). Minutes, not the run's hour: after one rank fails, the others
    must not sit in an all-reduce until `timeout_s` (issue 38, G4). Unverified on hardware: NCCL's
    watchdog enforces it only with async error handling on (torch's default since 2.2)."""
    gpu_name: str = ""
    """Marketing name of the GPU, '' on CPU."""
    gpu_memory_gb: float = 0.0
    """Memory per GPU in GB (10^9 bytes)."""
    peak_tflops: float = 0.0
    """Dense peak TFLOPS at `dtype` for MFU (A100 bf16 312, H100 SXM 989, V100 fp16 125, T4 fp16 65)."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"profile {self.name!r}: device={self.device!r}; use 'cpu' or 'cuda'")
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"profile {self.name!r}: backend={self.backend!r}; use 'gloo' or 'nccl'")
        if self.device == "cpu" and self.backend == "nccl":
            raise ConfigError(f"profile {self.name!r}: nccl needs CUDA; use backend='gloo' on CPU")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"profile {self.name!r}: dtype={self.dtype!r}; use one of {', '.join(_DTYPES)}")
        for field in ("nproc", "image_batch", "llm_batch", "seq_len", "image_size", "steps"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"profile {self.name!r}: {field}={value!r}; it must be a positive integer")
        for field in ("lr", "timeout_s", "collective_timeout_s"):
            if not getattr(self, field) > 0:
                raise ConfigError(f"profile {self.name!r}: {field}={getattr(self, field)!r}; it must be > 0")


def smoke() -> Profile:
    """CPU, gloo, tiny models, 2 ranks: seconds per run. What CI and GPU-less learners run."""
    return Profile(name="smoke", device="cpu", backend="gloo", nproc=2, dtype="float32",
                   llm_model="tiny-llama", vision_model="tiny-resnet", image_batch=16, llm_batch=8,
                   seq_len=32, image_size=32, steps=20, lr=3e-3, timeout_s=300.0,
                   collective_timeout_s=300.0)


def smoke_bf16() -> Profile:
    """`smoke` with bf16 mixed precision (autocast, FSDP2 MixedPrecisionPolicy, DeepSpeed bf16): the
    GPU profiles' precision branches on CPU, so CI runs them. Fewer steps and a smaller image batch keep
    the doubled suite short: bf16 convolutions are emulated on CPUs without AVX512-BF16 (~8x slower)."""
    return dataclasses.replace(smoke(), name="smoke-bf16", dtype="bfloat16", steps=4, image_batch=8)


def a100x4() -> Profile:
    """One 4x A100 80GB node (the course's 307G3Q3 / JOBG3Q3)."""
    return Profile(name="a100x4", device="cuda", backend="nccl", nproc=4, dtype="bfloat16",
                   llm_model="tinyllama-1.1b", vision_model="resnet50", image_batch=128, llm_batch=16,
                   seq_len=1024, image_size=224, steps=200, lr=1e-4, timeout_s=3600.0,
                   gpu_name="NVIDIA A100 80GB", gpu_memory_gb=80.0, peak_tflops=312.0)


def a100x1() -> Profile:
    """One A100 80GB (the course's gigaio-compute nodes)."""
    return dataclasses.replace(a100x4(), name="a100x1", nproc=1, image_batch=32, llm_batch=4)


def h100x1() -> Profile:
    """One H100 SXM 80GB."""
    return dataclasses.replace(a100x1(), name="h100x1", gpu_name="NVIDIA H100 80GB HBM3", peak_tflops=989.0)


def v100x4() -> Profile:
    """One 4x V100 node (P3-GPU-009 / -012): fp16 with a GradScaler, no bf16."""
    return dataclasses.replace(a100x4(), name="v100x4", dtype="float16", gpu_name="Tesla V100 32GB",
                               gpu_memory_gb=32.0, peak_tflops=125.0, llm_batch=8, seq_len=512)


def t4x2() -> Profile:
    """Kaggle's free "GPU T4 x2" notebook: two Tesla T4 16GB (Turing, compute capability 7.5, no bf16):
    fp16 with a GradScaler as on v100x4. TinyLlama's fp32 AdamW states (~17.6 GB) exceed one T4, so the
    LLM labs train the 160M Llama. Batches are the estimator's largest powers of 2 under HEADROOM of 16 GB
    for the fp32 single-GPU baselines (ResNet-50 128 x 224^2: ~11.3 GB; the 160M Llama 16 x 512: ~12.6 GB);
    every lab run is checked against the estimator in tests/test_gpu_profiles.py."""
    return Profile(name="t4x2", device="cuda", backend="nccl", nproc=2, dtype="float16",
                   llm_model="llama-160m", vision_model="resnet50", image_batch=128, llm_batch=16,
                   seq_len=512, image_size=224, steps=100, lr=1e-4, timeout_s=3600.0,
                   gpu_name="Tesla T4", gpu_memory_gb=16.0, peak_tflops=65.0)


def t4x1() -> Profile:
    """Colab's free T4 (one Tesla T4 16GB): the single-GPU labs; the multi-GPU ones say to use t4x2."""
    return dataclasses.replace(t4x2(), name="t4x1", nproc=1)


PROFILES: dict[str, Callable[[], Profile]] = {
    "smoke": smoke, "smoke-bf16": smoke_bf16, "a100x1": a100x1, "a100x4": a100x4, "h100x1": h100x1, "v100x4": v100x4,
    "t4x1": t4x1, "t4x2": t4x2,
}


def get_profile(name: str | Profile, **overrides) -> Profile:
    """The named profile with `overrides` applied; unknown names or fields raise ConfigError."""
    profile = name if isinstance(name, Profile) else None
    if profile is None:
        if name not in PROFILES:
            raise choices_error("profile", name, PROFILES)
        profile = PROFILES[name]()
    fields = {f.name: f.type for f in dataclasses.fields(Profile)}
    for key, value in overrides.items():
        if key not in fields:
            raise choices_error("profile field", key, fields)
        expected = type(getattr(profile, key))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
            overrides[key] = value
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ConfigError(f"profile field {key}={value!r} has type {type(value).__name__}; "
                              f"expected {expected.__name__}")
    return dataclasses.replace(profile, **overrides)
