"""`TrainConfig`: every knob of one training run in named sections, validated once, frozen.

    cfg.run.strategy, cfg.launch.nproc, cfg.optim.batch, cfg.precision.amp, cfg.memory.checkpointing,
    cfg.checkpoint.resume, cfg.peft.lora_rank, cfg.profiling.trace_steps

Field names are unique over all sections, so `labkit.train.run(amp='bf16', lora_rank=4, ...)` and
`labkit train --amp bf16 --lora-rank 4` keep their flat names: `FIELD_SECTION` (generated from the
dataclasses) maps each to its section, and the CLI options are generated from the same dataclasses
and their field docstrings (`labkit.cli.options`), so help, defaults and names cannot drift.
Precedence (STYLE.md #4): dataclass defaults < profile (`labkit.profiles`) < CLI / `run()` arguments.
Fields left `None` take the profile's value in `resolve()`, which keeps the `Profile` too (`cfg.profile`):
looked up once where a run starts, it reaches the ranks inside the resolved config's JSON, so every rank
runs exactly the same settings. Introduced in notebook 02_single_gpu.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

from labkit import optim, parallel
from labkit.errors import ConfigError, choices_error
from labkit.profiles import Profile
from labkit.zoo import hub, presets

AMP_MODES = ("bf16", "fp16", "none")
_AMP_OF_DTYPE = {"float32": "none", "bfloat16": "bf16", "float16": "fp16"}
AMP_DTYPES = {"none": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _count(name: str, value, *, minimum: int, optional: bool = False) -> None:
    """ConfigError unless `value` is an int >= minimum (or None when `optional`)."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        rule = "a positive integer" if minimum == 1 else "an integer >= 0"
        raise ConfigError(f"{name}={value!r}; it must be {rule}")


@dataclass(frozen=True)
class RunSection:
    """What trains on which data, for how long, and where the record goes."""

    strategy: str
    """Registry name in `labkit.parallel.STRATEGIES` ('single', 'ddp', 'fsdp', ...)."""
    model: str
    """Model preset ('tiny-resnet', 'tiny-llama', 'resnet50', 'tinyllama-1.1b', ...), local LLM folder or a
    Hugging Face id 'ORG/NAME' in the HF cache (`labkit fetch ID`; labkit.zoo.hub)."""
    profile: str = "smoke"
    """Profile name (`labkit.profiles.PROFILES`): device, default batch, lr, steps."""
    steps: int | None = None
    """Optimizer steps to run in total (a resumed run continues up to this count); default from the profile."""
    seed: int = 0
    """Seed of the model init, the data order and every RNG."""
    out: str = ""
    """Output folder: results.jsonl (appended, never overwritten) and checkpoints/; '' = $LABKIT_RUNS, else
    runs (`labkit.results.runs_root`)."""
    run_id: str = ""
    """Identifies this run's record in results.jsonl ('' = a fresh id, set by `run()`)."""
    data: str = "synthetic"
    """'synthetic', 'tiny' (the set shipped in labkit/data), 'food11' / 'dolly' (`labkit fetch NAME`) or a local
    path (ImageFolder dir / text or .jsonl file)."""
    seq_len: int | None = None
    """Tokens per LLM sequence; default from the profile."""
    image_size: int | None = None
    """Image side in pixels; default from the profile."""
    workers: int | None = None
    """DataLoader worker processes per rank; default 0 on CPU, 4 on GPU."""
    warmup_steps: int = 2
    """Steps excluded from the median step time (allocator warm-up, lazy init, compilation)."""
    eval_batches: int = 2
    """Held-out batches evaluated at the end of the run (0 = no evaluation)."""
    eval_at_start: bool = False
    """Also evaluate them before the first step (record extra 'eval_start_loss'): did fine-tuning help?"""
    progress: bool = True
    """tqdm progress bar on rank 0."""

    def __post_init__(self) -> None:
        parallel.check_name(self.strategy)
        model_kind(self.model)
        for name in ("steps", "seq_len", "image_size"):
            _count(name, getattr(self, name), minimum=1, optional=True)
        for name in ("warmup_steps", "eval_batches", "seed"):
            _count(name, getattr(self, name), minimum=0)


@dataclass(frozen=True)
class LaunchSection:
    """How many processes run, on how many nodes (torchrun)."""

    nproc: int = 1
    """Ranks per node; > 1 launches the run under torchrun."""
    nnodes: int = 1
    """Nodes in the job (torchrun rendezvous)."""
    node_rank: int = 0
    """This node's rank in 0..nnodes-1."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the rendezvous (the head node) when nnodes > 1."""
    threads: int | None = None
    """Intra-op (OpenMP) threads per rank, also for a run in this process; default: a launched rank gets
    `labkit.runtime.launch.cpu_threads` (1, or cores / ranks for CPU-heavy strategies), an in-process run torch's
    default (every core). Give runs you compare by time the same count (notebook 03's ladder: 1)."""

    def __post_init__(self) -> None:
        _count("nproc", self.nproc, minimum=1)
        if self.threads is not None:
            _count("threads", self.threads, minimum=1)
        _count("nnodes", self.nnodes, minimum=1)
        _count("node_rank", self.node_rank, minimum=0)
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(f"nnodes={self.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")


@dataclass(frozen=True)
class OptimSection:
    """The batch and the optimizer step."""

    batch: int | None = None
    """GLOBAL batch (samples per optimizer step, over all data-parallel ranks and micro-batches); default
    from the profile."""
    accum: int = 1
    """Gradient-accumulation micro-batches per optimizer step (the global batch stays the same)."""
    microbatches: int | None = None
    """Pipeline micro-batches per accumulation chunk (pipeline-gpipe / -1f1b); None = 2 x stages."""
    lr: float | None = None
    """Learning rate; default from the profile (no automatic scaling with the batch)."""
    optimizer: str | None = field(default=None, metadata={"choices": tuple(optim.OPTIMIZERS)})
    """Optimizer state format in `labkit.optim.OPTIMIZERS` (adamw-8bit: Dettmers et al. 2022);
    None = the strategy's default (AdamW; qlora: paged-adamw-8bit)."""

    def __post_init__(self) -> None:
        for name in ("batch", "accum", "microbatches"):
            _count(name, getattr(self, name), minimum=1, optional=name != "accum")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"lr={self.lr!r}; it must be > 0")
        if self.optimizer is not None:
            optim.check_name(self.optimizer)


@dataclass(frozen=True)
class PrecisionSection:
    """Numerics and kernels: mixed precision, memory format, compilation."""

    amp: str | None = field(default=None, metadata={"choices": AMP_MODES})
    """'bf16', 'fp16' (with a GradScaler) or 'none' (fp32); default from the profile's dtype."""
    channels_last: bool = False
    """NHWC memory format for image models (faster convolutions on tensor cores)."""
    compile: bool = False
    """torch.compile the model (meant for GPU profiles; on CPU it needs a C++ compiler and is slow)."""

    def __post_init__(self) -> None:
        if self.amp is not None and self.amp not in AMP_MODES:
            raise choices_error("amp mode", self.amp, AMP_MODES)


@dataclass(frozen=True)
class MemorySection:
    """Memory levers and limits."""

    checkpointing: bool = False
    """Activation checkpointing of every block (recompute activations in backward)."""
    find_max_batch: bool = False
    """Find the largest micro-batch that fits instead of training, then exit (GPU; CPU needs
    memory_budget_mb)."""
    memory_budget_mb: float | None = None
    """Memory budget (MiB) for the max-batch finder on CPU, where nothing runs out of memory."""
    memory_cap_gb: float | None = None
    """Train as if the device had this many GB (10^9 B): the CUDA allocator's limit, on CPU the tracked
    peak (labkit.train.memcap); e.g. 24 for the RTX 4090 scenario on an 80 GB A100 (06_peft)."""

    def __post_init__(self) -> None:
        if self.memory_cap_gb is not None and (isinstance(self.memory_cap_gb, bool) or not self.memory_cap_gb > 0):
            raise ConfigError(f"memory_cap_gb={self.memory_cap_gb!r}; give a size in GB > 0, e.g. --memory-cap-gb 24")


@dataclass(frozen=True)
class CheckpointSection:
    """Saving, resuming, and stopping before a lease ends."""

    checkpoint_every: int = 0
    """Save a DCP checkpoint every K steps to OUT/checkpoints/step_N (0 = only at a deadline)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in OUT/checkpoints."""
    deadline: str | None = None
    """ISO time with offset (e.g. the lease end '2026-02-27T14:55-05:00'): checkpoint and stop before it."""
    deadline_margin_s: float | None = field(default=None, metadata={"option": "--deadline-margin"})
    """Seconds to stop before the deadline; default max(60 s, 2 x the slowest checkpoint save)."""

    def __post_init__(self) -> None:
        _count("checkpoint_every", self.checkpoint_every, minimum=0)
        if self.deadline is not None:
            parse_deadline(self.deadline)


@dataclass(frozen=True)
class PeftSection:
    """LoRA knobs (lora / qlora strategies); labkit.parallel.peft checks the targets against the model."""

    lora_rank: int = 8
    """LoRA rank r (lora / qlora strategies)."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update B A is multiplied by alpha / r."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input (0 keeps single and data-parallel runs loss-for-loss equal)."""
    lora_targets: str = "q,v"
    """Linear layers LoRA adapts: 'q,v', 'q,k,v,o', full names like 'q_proj', or 'all-linear'."""
    lora_parallel: str = field(default="ddp", metadata={"choices": ("ddp", "fsdp")})
    """How lora spreads over --nproc > 1 ranks: 'ddp' (replicated base) or 'fsdp' (FSDP2-sharded base)."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool) or self.lora_rank < 1:
            raise ConfigError(f"lora_rank={self.lora_rank!r}; it must be a positive integer such as 8")
        if not self.lora_alpha > 0 or not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_alpha={self.lora_alpha!r} must be > 0 and lora_dropout={self.lora_dropout!r} "
                              "in [0, 1)")
        if not self.lora_targets.strip(" ,"):
            raise ConfigError("lora_targets is empty; name the layers to adapt, e.g. 'q,v' or 'all-linear'")
        if self.lora_parallel not in ("ddp", "fsdp"):
            raise choices_error("lora_parallel mode", self.lora_parallel, ("ddp", "fsdp"))


@dataclass(frozen=True)
class ProfilingSection:
    """torch.profiler / Nsight Systems traces of a few steps (notebook 08, docs/profiling.md)."""

    trace_steps: int = 0
    """Record this many steps (after the 2 measurement steps) with torch.profiler into OUT/profiles/<run id>/."""
    trace_with: str = field(default="torch", metadata={"choices": ("torch", "nsys")})
    """'torch' (torch.profiler files) or 'nsys' (only mark the steps for `nsys profile`; GPU profiles)."""

    def __post_init__(self) -> None:
        _count("trace_steps", self.trace_steps, minimum=0)
        if self.trace_with not in ("torch", "nsys"):
            raise choices_error("trace tool", self.trace_with, ("torch", "nsys"))


@dataclass(frozen=True)
class TrainConfig:
    """One training run. `None` means "the profile's value" until `resolve()` fills it in.

    Build one from flat names with `TrainConfig.of(strategy='single', model='tiny-llama', amp='bf16')`
    (or `from_dict`, what `run()` and the CLI use); change it with `cfg.replace(amp='bf16')`."""

    run: RunSection
    launch: LaunchSection = field(default_factory=LaunchSection)
    optim: OptimSection = field(default_factory=OptimSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    memory: MemorySection = field(default_factory=MemorySection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    peft: PeftSection = field(default_factory=PeftSection)
    profiling: ProfilingSection = field(default_factory=ProfilingSection)
    resolved_profile: Profile | None = None
    """The Profile `resolve()` filled the config from (None before): read it as `cfg.profile`."""

    def __post_init__(self) -> None:
        if not isinstance(self.resolved_profile, (Profile, type(None))):
            raise ConfigError(f"TrainConfig.resolved_profile={self.resolved_profile!r}; let cfg.resolve() set it")
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"TrainConfig.{name} must be a {cls.__name__}, not {getattr(self, name)!r}; "
                                  "build configs with labkit.train.config.from_dict")
        if self.precision.channels_last and self.kind != "vision":
            raise ConfigError(f"--channels-last applies to image models, not {self.run.model!r}; drop the flag")

    def __getattr__(self, name: str):
        # Only reached for a missing attribute: name the section a flat name moved to.
        if name in FIELD_SECTION:
            raise AttributeError(f"TrainConfig has no attribute {name!r}; it is cfg.{FIELD_SECTION[name]}.{name}")
        raise AttributeError(f"TrainConfig has no attribute {name!r}")

    @classmethod
    def of(cls, **values) -> "TrainConfig":
        """From flat keyword values: `from_dict(values)`."""
        return from_dict(values)

    @property
    def kind(self) -> str:
        """'llm' or 'vision'."""
        return model_kind(self.run.model)

    @property
    def world_size(self) -> int:
        return self.launch.nproc * self.launch.nnodes

    @property
    def profile(self) -> Profile:
        """The resolved run's Profile (its name: `cfg.run.profile`); ConfigError before `resolve()`."""
        if self.resolved_profile is None:
            raise ConfigError(f"this TrainConfig ({self.run.strategy}, {self.run.model}) is not resolved yet; "
                              "build it with labkit.train.make_config or call cfg.resolve() before running it")
        return self.resolved_profile

    def flat(self) -> dict:
        """{field: value} with the flat names `run()` and the CLI use (the inverse of `from_dict`)."""
        return {name: getattr(getattr(self, section), name) for name, section in FIELD_SECTION.items()}

    def replace(self, **changes) -> "TrainConfig":
        """A validated copy with flat fields (amp='bf16') or whole sections (precision=...) changed."""
        unknown = sorted(set(changes) - set(FIELD_SECTION) - set(SECTIONS))
        if unknown:
            raise choices_error("train option", unknown[0], FIELD_SECTION)
        sections = {k: v for k, v in changes.items() if k in SECTIONS}
        for name, value in changes.items():
            if name in FIELD_SECTION:
                section = FIELD_SECTION[name]
                sections[section] = dataclasses.replace(sections.get(section, getattr(self, section)), **{name: value})
        if "run" in sections and self.resolved_profile is not None and \
                sections["run"].profile != self.resolved_profile.name:
            sections["resolved_profile"] = None  # another profile: resolve() again
        return dataclasses.replace(self, **sections)

    def resolve(self, profile: Profile | None = None) -> "TrainConfig":
        """A copy with every `None` replaced by the profile's value, an empty `out` by the results root, and
        the Profile kept (`cfg.profile`): the one place a run looks its profile up by name (idempotent: a
        resolved config keeps its Profile). `amp` left None takes the profile's dtype: a run that must be
        fp32 on every profile (a baseline) says amp='none'. `profile`: a `Profile` object standing in for
        the named one (`labkit.course.profile_check` sizes changed profiles with it)."""
        from labkit.profiles import get_profile

        prof = profile or self.resolved_profile or get_profile(self.run.profile)
        llm = self.kind == "llm"
        fill = dict(steps=prof.steps, lr=prof.lr, amp=_AMP_OF_DTYPE[prof.dtype],
                    batch=prof.llm_batch if llm else prof.image_batch, seq_len=prof.seq_len,
                    image_size=prof.image_size, workers=0 if prof.device == "cpu" else 4)
        flat = self.flat()
        fill = {k: v for k, v in fill.items() if flat[k] is None}
        if not flat["out"]:  # the results root: $LABKIT_RUNS, else runs
            from labkit.results import runs_root
            fill["out"] = runs_root()
        return dataclasses.replace(self.replace(**fill), resolved_profile=prof)

    def to_json(self) -> str:
        """Nested JSON: {"run": {...}, "launch": {...}, ...}."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        """From `to_json` text, or the flat JSON object older labkit versions wrote."""
        return from_dict(json.loads(text))


#: section name -> its dataclass, in TrainConfig's order.
SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(TrainConfig)[f.name] for f in dataclasses.fields(TrainConfig)
                             if f.name != "resolved_profile"}
#: flat field name (run() keyword, CLI option) -> its section: THE table, generated from the dataclasses.
FIELD_SECTION: dict[str, str] = {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def from_dict(values: dict) -> TrainConfig:
    """TrainConfig from flat keyword values ({'amp': 'bf16', ...}), nested sections ({'precision': {...}})
    or both; unknown names are a ConfigError listing the valid ones."""
    grouped: dict[str, dict] = {section: {} for section in SECTIONS}
    resolved = None
    for key, value in values.items():
        if key == "resolved_profile":  # a resolved config's JSON (to_json): its Profile, rebuilt and re-validated
            resolved = Profile(**value) if isinstance(value, dict) else value
        elif key in SECTIONS and isinstance(value, dict):
            for name, inner in value.items():
                if FIELD_SECTION.get(name) != key:
                    valid = [n for n, s in FIELD_SECTION.items() if s == key]
                    raise choices_error(f"{key} option", name, valid)
                grouped[key][name] = inner
        elif key in FIELD_SECTION:
            grouped[FIELD_SECTION[key]][key] = value
        else:
            raise choices_error("train option", key, FIELD_SECTION)
    missing = [k for k in ("strategy", "model") if grouped["run"].get(k) is None]
    if missing:
        raise ConfigError(f"training needs {' and '.join(missing)}: e.g. strategy='single', model='tiny-resnet'")
    return TrainConfig(**{section: cls(**grouped[section]) for section, cls in SECTIONS.items()}, resolved_profile=resolved)


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
