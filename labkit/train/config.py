"""`TrainConfig`: every knob of one training run, validated once, frozen.

Precedence (STYLE.md #4): dataclass defaults < profile (`labkit.profiles`) < CLI / `run()` arguments.
Fields left `None` take the profile's value in `resolve()`; the launched ranks receive the resolved
config as JSON, so every rank runs exactly the same settings. Introduced in notebook 02_single_gpu.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
from dataclasses import dataclass
from pathlib import Path

from labkit import hub, optim, parallel, presets
from labkit.errors import ConfigError, choices_error

AMP_MODES = ("bf16", "fp16", "none")
_AMP_OF_DTYPE = {"float32": "none", "bfloat16": "bf16", "float16": "fp16"}
AMP_DTYPES = {"none": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class TrainConfig:
    """One training run. `None` means "the profile's value" until `resolve()` fills it in."""

    strategy: str
    """Registry name in `labkit.parallel.STRATEGIES` ('single', 'ddp', 'fsdp', ...)."""
    model: str
    """Model preset ('tiny-resnet', 'tiny-llama', 'resnet50', 'tinyllama-1.1b', ...), local LLM folder or a
    Hugging Face id 'ORG/NAME' in the HF cache (`labkit fetch ID`; labkit.hub)."""
    profile: str = "smoke"
    """Profile name (`labkit.profiles.PROFILES`): device, default batch, lr, steps."""
    nproc: int = 1
    """Ranks per node; > 1 launches the run under torchrun."""
    nnodes: int = 1
    """Nodes in the job (torchrun rendezvous)."""
    node_rank: int = 0
    """This node's rank in 0..nnodes-1."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the rendezvous (the head node) when nnodes > 1."""
    steps: int | None = None
    """Optimizer steps to run in total (a resumed run continues up to this count)."""
    out: str = "runs"
    """Output folder: results.jsonl (appended, never overwritten) and checkpoints/."""
    seed: int = 0
    """Seed of the model init, the data order and every RNG."""
    amp: str | None = None
    """'bf16', 'fp16' (with a GradScaler) or 'none' (fp32); default from the profile's dtype."""
    accum: int = 1
    """Gradient-accumulation micro-batches per optimizer step (the global batch stays the same)."""
    microbatches: int | None = None
    """Pipeline micro-batches per accumulation chunk (pipeline-gpipe / -1f1b); None = 2 x stages."""
    checkpointing: bool = False
    """Activation checkpointing of every block (recompute activations in backward)."""
    batch: int | None = None
    """GLOBAL batch (samples per optimizer step, over all data-parallel ranks and micro-batches)."""
    lr: float | None = None
    """Learning rate; default from the profile (no automatic scaling with the batch)."""
    optimizer: str | None = None
    """Optimizer name in `labkit.optim.OPTIMIZERS` ('adamw', 'adamw-8bit', 'paged-adamw-8bit', 'sgd', ...);
    None = the strategy's default (AdamW; qlora: paged-adamw-8bit)."""
    channels_last: bool = False
    """NHWC memory format for image models (faster convolutions on tensor cores)."""
    compile: bool = False
    """torch.compile the model (meant for GPU profiles; on CPU it needs a C++ compiler and is slow)."""
    checkpoint_every: int = 0
    """Save a DCP checkpoint every K steps to OUT/checkpoints/step_N (0 = only at a deadline)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in OUT/checkpoints."""
    deadline: str | None = None
    """ISO time with offset (e.g. the lease end '2026-02-27T14:55-05:00'): checkpoint and stop before it."""
    deadline_margin_s: float | None = None
    """Stop this long before the deadline; default max(60 s, 2 x the slowest checkpoint save)."""
    find_max_batch: bool = False
    """Find the largest micro-batch that fits instead of training (GPU; CPU needs memory_budget_mb)."""
    memory_budget_mb: float | None = None
    """Memory budget (MiB) for the max-batch finder on CPU, where nothing runs out of memory."""
    memory_cap_gb: float | None = None
    """Train as if the device had this many GB (10^9 B): the CUDA allocator's limit, on CPU the tracked
    peak (labkit.train.memcap); e.g. 24 for the RTX 4090 scenario on an 80 GB A100 (06_peft)."""
    data: str = "synthetic"
    """'synthetic', 'tiny' (the set shipped in labkit/data), 'food11' / 'dolly' (`labkit fetch NAME`) or a local
    path (ImageFolder dir / text or .jsonl file)."""
    seq_len: int | None = None
    """Tokens per LLM sequence; default from the profile."""
    image_size: int | None = None
    """Image side in pixels; default from the profile."""
    warmup_steps: int = 2
    """Steps excluded from the median step time (allocator warm-up, lazy init, compilation)."""
    eval_batches: int = 2
    """Held-out batches evaluated at the end of the run (0 = no evaluation)."""
    eval_at_start: bool = False
    """Also evaluate them before the first step (record extra 'eval_start_loss'): did fine-tuning help?"""
    workers: int | None = None
    """DataLoader worker processes per rank; default 0 on CPU, 4 on GPU."""
    progress: bool = True
    """tqdm progress bar on rank 0."""
    lora_rank: int = 8
    """LoRA rank r (lora / qlora strategies)."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update B A is multiplied by alpha / r."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input (0 keeps single and data-parallel runs loss-for-loss equal)."""
    lora_targets: str = "q,v"
    """Linear layers LoRA adapts: 'q,v', 'q,k,v,o', full names like 'q_proj', or 'all-linear'."""
    lora_parallel: str = "ddp"
    """How lora spreads over --nproc > 1 ranks: 'ddp' (replicated base) or 'fsdp' (FSDP2-sharded base)."""
    trace_steps: int = 0
    """Record this many steps (after the 2 measurement steps) with torch.profiler into OUT/profiles/ (08)."""
    trace_with: str = "torch"
    """'torch' (torch.profiler files) or 'nsys' (only mark the steps for Nsight Systems; GPU profiles)."""
    run_id: str = ""
    """Identifies this run's record in results.jsonl (set by `run()`)."""

    def __post_init__(self) -> None:
        parallel.check_name(self.strategy)
        model_kind(self.model)
        if self.optimizer is not None:
            optim.check_name(self.optimizer)
        if self.amp is not None and self.amp not in AMP_MODES:
            raise choices_error("amp mode", self.amp, AMP_MODES)
        for name in ("nproc", "nnodes", "accum", "steps", "batch", "seq_len", "image_size", "microbatches"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name}={value!r}; it must be a positive integer")
        for name in ("checkpoint_every", "warmup_steps", "eval_batches", "seed", "node_rank", "trace_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name}={value!r}; it must be an integer >= 0")
        if self.memory_cap_gb is not None and (isinstance(self.memory_cap_gb, bool) or not self.memory_cap_gb > 0):
            raise ConfigError(f"memory_cap_gb={self.memory_cap_gb!r}; give a size in GB > 0, e.g. --memory-cap-gb 24")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"lr={self.lr!r}; it must be > 0")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(f"nnodes={self.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
        if self.deadline is not None:
            parse_deadline(self.deadline)
        if self.channels_last and model_kind(self.model) != "vision":
            raise ConfigError(f"--channels-last applies to image models, not {self.model!r}; drop the flag")
        self._check_peft()
        if self.trace_with not in ("torch", "nsys"):
            raise choices_error("trace tool", self.trace_with, ("torch", "nsys"))

    def _check_peft(self) -> None:
        """LoRA knobs (labkit.parallel.peft checks the target names against the built model)."""
        if not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool) or self.lora_rank < 1:
            raise ConfigError(f"lora_rank={self.lora_rank!r}; it must be a positive integer such as 8")
        if not self.lora_alpha > 0 or not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_alpha={self.lora_alpha!r} must be > 0 and lora_dropout={self.lora_dropout!r} "
                              "in [0, 1)")
        if not self.lora_targets.strip(" ,"):
            raise ConfigError("lora_targets is empty; name the layers to adapt, e.g. 'q,v' or 'all-linear'")
        if self.lora_parallel not in ("ddp", "fsdp"):
            raise choices_error("lora_parallel mode", self.lora_parallel, ("ddp", "fsdp"))

    @property
    def kind(self) -> str:
        """'llm' or 'vision'."""
        return model_kind(self.model)

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def resolve(self, profile=None) -> "TrainConfig":
        """A copy with every `None` replaced by the profile's value (idempotent). `amp` left None takes
        the profile's dtype: a run that must be fp32 on every profile (a baseline) says amp='none'.
        `profile`: a `Profile` object standing in for the named one (`labkit.course.profile_check` sizes
        changed profiles with it)."""
        from labkit.profiles import get_profile

        prof = profile if profile is not None else get_profile(self.profile)
        llm = self.kind == "llm"
        fill = dict(steps=prof.steps, lr=prof.lr, amp=_AMP_OF_DTYPE[prof.dtype],
                    batch=prof.llm_batch if llm else prof.image_batch, seq_len=prof.seq_len,
                    image_size=prof.image_size, workers=0 if prof.device == "cpu" else 4)
        return dataclasses.replace(self, **{k: v for k, v in fill.items() if getattr(self, k) is None})

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        return from_dict(json.loads(text))


def from_dict(values: dict) -> TrainConfig:
    """TrainConfig from keyword values; unknown keys are a ConfigError listing the valid ones."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise choices_error("train option", unknown[0], known)
    missing = [k for k in ("strategy", "model") if values.get(k) is None]
    if missing:
        raise ConfigError(f"training needs {' and '.join(missing)}: e.g. strategy='single', model='tiny-resnet'")
    return TrainConfig(**values)


def model_kind(name: str) -> str:
    """'llm' (preset, local checkpoint folder or cached HF id) or 'vision'; ConfigError listing trainable models."""
    if name in presets.LLM_PRESETS or (Path(name) / "config.json").is_file():
        return "llm"
    if hub.is_hub_id(name):
        hub.resolve(name)  # not cached: the error names `labkit fetch ID`, before any launch
        return "llm"
    if name in presets.VISION_PRESETS:
        return "vision"
    valid = list(presets.LLM_PRESETS) + list(presets.VISION_PRESETS)
    valid += ["<local checkpoint folder>", "<cached HF id ORG/NAME>"]
    raise choices_error("model", name, valid)


def parse_deadline(text: str) -> _dt.datetime:
    """An aware datetime from an ISO time with offset ('Z' allowed); naive times are an error."""
    try:
        when = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise ConfigError(f"deadline {text!r} is not an ISO time; write e.g. 2026-02-27T14:55:00-05:00") from exc
    if when.tzinfo is None:
        raise ConfigError(f"deadline {text!r} has no UTC offset; add one, e.g. {text}-05:00 or {text}Z, "
                          "so every node reads the same instant")
    return when
