"""Does every lab's GPU branch fit and make sense on a profile? Resolved and checked on CPU.

A profile is a promise that each lab runs on its first try on that machine. `check_profile(name)`
resolves every training run the lab notebooks make on the profile (`lab_runs`: the same strategies,
models and explicit precisions as the notebook cells), runs each strategy's own `check` (strategy x
model pairs it refuses come back with the reason), and compares `labkit.memory.estimate`'s bytes per
GPU with `HEADROOM` of the profile's GPU memory. `precision_problem` says when a profile's dtype does
not suit its GPU (bf16 on Volta has no tensor cores). Tests run it for every profile, so a profile
that would OOM or mismatch fails a test, not a class; `labkit preflight` runs it on the node.
Introduced in notebook 00_setup (docs/gpu-node.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from labkit.errors import ConfigError
from labkit.profiles import Profile, get_profile

#: Share of a GPU's memory the estimator's bytes may fill. The rest is the CUDA context (~0.5-1 GB),
#: NCCL buffers, allocator fragmentation and the estimator's own error (docs/memory.md: within ~10%).
HEADROOM = 0.85
#: Compute capability of each GPU family the profiles name (bf16 tensor cores need >= 8.0).
CAPABILITY = {"V100": (7, 0), "A100": (8, 0), "H100": (9, 0)}
#: TrainConfig.amp of a dtype; the mixed-precision mode a lab uses where it says "AMP".
AMP_OF_DTYPE = {"float32": "none", "bfloat16": "bf16", "float16": "fp16"}
#: Estimator precision of each amp mode: torch keeps fp32 master params under autocast (16 B/param
#: with AdamW either way); activations are 2 B in mixed precision.
_PRECISION = {"none": "fp32", "bf16": "mixed-bf16", "fp16": "mixed-fp16"}


@dataclass(frozen=True)
class Item:
    """One lab run on one profile: resolved, refused or over budget."""

    lab: str
    label: str
    strategy: str
    model: str
    ok: bool
    reason: str = ""
    """Why not (a strategy's refusal, the bytes over budget); '' when ok."""
    bytes_per_gpu: int | None = None
    """The estimator's bytes per GPU (None on CPU profiles: no fixed capacity)."""
    capacity: float | None = None
    """HEADROOM x the GPU's memory in bytes."""
    options: dict = field(default_factory=dict)


def amp_of(profile: Profile) -> str:
    """The mixed-precision mode for the profile's dtype ('bf16', 'fp16'; 'bf16' for an fp32 profile,
    so the lever runs compare a real mixed-precision run with the fp32 baseline everywhere)."""
    return "fp16" if profile.dtype == "float16" else "bf16"


def precision_problem(profile: Profile) -> str | None:
    """None when the profile's dtype suits its GPU; else what is wrong and the fix."""
    if profile.device == "cpu":
        return None if profile.dtype != "float16" else (
            f"profile {profile.name!r}: fp16 autocast on CPU is not what a GPU runs; use bfloat16 or float32")
    family = next((f for f in CAPABILITY if f in profile.gpu_name), None)
    if family is None:
        return f"profile {profile.name!r}: unknown GPU {profile.gpu_name!r}; add its family to CAPABILITY"
    from labkit.envinfo import BF16_CAPABILITY

    want = "bfloat16" if CAPABILITY[family] >= BF16_CAPABILITY else "float16"
    if profile.dtype != want:
        return (f"profile {profile.name!r}: dtype {profile.dtype} on {family} (compute capability "
                f"{'.'.join(map(str, CAPABILITY[family]))}); use {want}")
    return None


def lab_runs(profile: Profile) -> list[tuple[str, str, str, str, dict]]:
    """(lab, label, strategy, model, options) of every training run the lab notebooks make on
    `profile`, with the precision each run states. Keep in step with the notebooks' run cells."""
    from labkit.train.memcap import scenario_cap_gb

    amp, n = amp_of(profile), profile.nproc
    vis, llm = profile.vision_model, profile.llm_model
    cap = scenario_cap_gb(profile, llm)  # 06 runs every PEFT run under "the 24 GB GPU" cap
    pipe_amp = "none" if profile.dtype == "float16" else amp  # pipelines refuse fp16 (07's setup cell)
    runs = [("02_single", "baseline", "single", vis, dict(amp="none")),
            ("02_single", "amp", "single", vis, dict(amp=amp)),
            ("02_single", "accum", "single", vis, dict(amp="none", accum=2)),
            ("02_single", "checkpointing", "single", vis, dict(amp="none", checkpointing=True)),
            ("02_single", "channels_last", "single", vis, dict(amp=amp, channels_last=True)),
            ("06_peft", "lora", "lora", llm, dict(checkpointing=True, memory_cap_gb=cap)),
            ("06_peft", "qlora", "qlora", llm, dict(checkpointing=True, memory_cap_gb=cap))]
    if n >= 2:
        runs += [("03_ddp", "ddp1", "single", vis, {}), ("03_ddp", f"ddp{n}", "ddp", vis, dict(nproc=n)),
                 ("03_ddp", "llm single", "single", llm, single_levers(profile, llm)),
                 ("03_ddp", "ddp_accum", "ddp", llm, dict(nproc=n, accum=2))]
        runs += [("04_fsdp", s, s, llm, dict(nproc=n, amp="none")) for s in
                 ("ddp", "fsdp", "fsdp-grad-op", "fsdp-no-shard", "fsdp-hybrid", "fsdp-offload")]
        runs += [("04_fsdp", f"fsdp-{amp}", "fsdp", llm, dict(nproc=n, amp=amp))]
        runs += [("05_zero", s, s, llm, dict(nproc=n)) for s in
                 ("ddp", "zero1", "zero2", "zero3", "zero3-offload", "fsdp-grad-op", "fsdp")]
        fit = single_levers(profile, llm, amp=pipe_amp)
        runs += [("07_model_parallel", "single", "single", llm, dict(amp=pipe_amp, **fit))]
        runs += [("07_model_parallel", s, s, llm, dict(nproc=n, amp=pipe_amp, microbatches=2 * n))
                 for s in ("pipeline-gpipe", "pipeline-1f1b", "tensor-fsdp")]
        runs += [("08_profiling", s, s, llm, dict(nproc=n)) for s in ("ddp", "fsdp", "fsdp-qlora")]
        runs += [("09_beyond_3d", s, s, llm, dict(nproc=n, amp=pipe_amp, microbatches=2 * n))
                 for s in ("pipeline-interleaved", "pipeline-zero-bubble")]
        runs += [("09_beyond_3d", "context-parallel", "context-parallel", llm, dict(nproc=n, amp=pipe_amp)),
                 ("09_beyond_3d", "moe single", "single", "tiny-moe", dict(amp=pipe_amp)),
                 ("09_beyond_3d", "expert-parallel", "expert-parallel", "tiny-moe", dict(nproc=n, amp=pipe_amp))]
    # Not listed: 04's "DDP runs out of memory where FSDP fits" pair, whose DDP run must not fit.
    return runs


def memory_config(cfg):
    """The `labkit.memory.estimate.MemoryConfig` of a resolved TrainConfig (bytes per GPU)."""
    from labkit import parallel
    from labkit.memory.estimate import MemoryConfig
    from labkit.parallel.studies import ESTIMATE_FIELDS

    dims = parallel.strategy_class(cfg.run.strategy).dims_for(cfg, cfg.world_size)
    dp = dims.dp_size
    fields = dict(ESTIMATE_FIELDS.get(cfg.run.strategy, {}))
    if cfg.run.strategy == "fsdp-offload":
        fields["offload"] = "optimizer+params"  # CPUOffloadPolicy: the ZeRO-3 shards live on the host
    if cfg.run.strategy == "fsdp-hybrid":
        fields["zero_group"] = dims.dp_shard  # ranks per node
    peft = cfg.run.strategy in ("lora", "qlora", "fsdp-qlora", "fsdp-qlora-offload")
    if peft:
        fields.update(lora_rank=cfg.peft.lora_rank, lora_targets=cfg.peft.lora_targets)
        if "qlora" in cfg.run.strategy:
            fields["quant"] = "nf4-dq"
        if cfg.run.strategy.startswith("fsdp-"):
            fields["zero"] = 3
    tp, pp, cp, ep = dims.tp, dims.pp, dims.cp, dims.ep  # cp: 1/cp of every sequence; ep: 1/ep of the experts
    optimizer = cfg.optim.optimizer or ("paged-adamw-8bit" if "qlora" in cfg.run.strategy else "adamw")
    return MemoryConfig(model=cfg.run.model, precision=_PRECISION[cfg.precision.amp], optimizer=optimizer, dp=dp, tp=tp, pp=pp,
                        cp=cp, ep=ep, batch=max(cfg.optim.accum, cfg.optim.batch // dp), grad_accum=cfg.optim.accum,
                        seq=cfg.run.seq_len if cfg.kind == "llm" else None,
                        # ResNet checkpointing is not modelled: its bytes without it are an upper bound.
                        checkpointing="full" if cfg.memory.checkpointing and cfg.kind == "llm" else "none", **fields)


def capacity(profile: Profile) -> float | None:
    """Bytes the estimate may use on one of the profile's GPUs; None on CPU."""
    return HEADROOM * profile.gpu_memory_gb * 1e9 if profile.device == "cuda" else None


def check_run(profile: Profile, lab: str, label: str, strategy: str, model: str, options: dict) -> Item:
    """Resolve one run like `labkit.train.run` would (no launch, no hardware needed) and size it."""
    from labkit import parallel
    from labkit.memory.estimate import estimate
    from labkit.train.config import from_dict

    item = dict(lab=lab, label=label, strategy=strategy, model=model, options=dict(options))
    try:
        cfg = from_dict({"strategy": strategy, "model": model, "profile": profile.name, **options}).resolve(profile)
        parallel.strategy_class(strategy).check(cfg, cfg.world_size)
    except ConfigError as exc:
        return Item(ok=False, reason=str(exc), **item)
    cap = capacity(profile)
    if cap is None:
        return Item(ok=True, **item)
    try:
        used = estimate(memory_config(cfg)).total
    except ConfigError as exc:
        return Item(ok=False, reason=f"the estimator cannot size this run: {exc}", **item)
    if used > cap:
        return Item(ok=False, bytes_per_gpu=used, capacity=cap, **item,
                    reason=f"estimated {used / 1e9:.1f} GB per GPU > {HEADROOM:.0%} of {profile.gpu_memory_gb:g} GB; "
                           "lower the batch or add checkpointing in the profile")
    return Item(ok=True, bytes_per_gpu=used, capacity=cap, **item)


def check_profile(name: str | Profile) -> list[Item]:
    """Every lab run of the profile, checked; plus one item for the profile's precision."""
    profile = get_profile(name)
    items = [check_run(profile, *run) for run in lab_runs(profile)]
    problem = precision_problem(profile)
    items.append(Item(lab="profile", label="precision", strategy="-", model=profile.gpu_name or "cpu",
                      ok=problem is None, reason=problem or ""))
    return items


def single_levers(profile: Profile, model: str, *, amp: str | None = None) -> dict:
    """Levers that make ONE GPU hold a single-device run of the profile's global batch (notebooks 03, 07:
    the baseline the parallel runs are compared with, loss for loss): {} when it fits as is, else
    activation checkpointing, then also 2, 4, 8 ... accumulation micro-batches (same global batch, same
    losses). Sized with the estimator under HEADROOM; CPU profiles get {} (smoke runs fit)."""
    from labkit.memory.estimate import estimate
    from labkit.train.config import from_dict

    cap = capacity(profile)
    if cap is None:
        return {}
    base = from_dict({"strategy": "single", "model": model, "profile": profile.name,
                      **({"amp": amp} if amp else {})}).resolve(profile)
    tries = [{}] + [dict(checkpointing=True, **({"accum": a} if a > 1 else {})) for a in (1, 2, 4, 8, 16)]
    for levers in tries:
        if levers.get("accum", 1) > base.optim.batch:
            break
        cfg = base.replace(**levers)
        if estimate(memory_config(cfg)).total <= cap:
            return levers
    raise ConfigError(f"{model} at global batch {base.optim.batch} does not fit one {profile.gpu_name} even with "
                      "checkpointing and accumulation; lower the profile's llm_batch or seq_len")
