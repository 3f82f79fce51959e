"""Does every lab's GPU branch fit and make sense on a profile? Resolved and checked on CPU.

A profile is a promise that each lab runs on its first try on that machine. `check_profile(name)`
resolves every training run the lab notebooks make on the profile (`lab_runs`: what a rehearsal of
the notebooks observed, `labkit.course.rehearse`), runs each strategy's own `check` (strategy x
model pairs it refuses come back with the reason), and compares `labkit.memory.estimate`'s bytes per
GPU with `HEADROOM` of the profile's GPU memory (or of a run's `memory_cap_gb`). `precision_problem` says when a profile's dtype does
not suit its GPU (bf16 on Volta has no tensor cores). Tests run it for every profile, so a profile
that would OOM or mismatch fails a test, not a class; `labkit preflight` runs it on the node.
Introduced in notebook 00_setup (docs/gpu-node.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from labkit.errors import ConfigError
from labkit.memory import runs
from labkit.memory.runs import HEADROOM, memory_config
from labkit.profiles import Profile, get_profile

#: Compute capability of each GPU family the profiles name (bf16 tensor cores need >= 8.0).
CAPABILITY = {"V100": (7, 0), "T4": (7, 5), "A100": (8, 0), "H100": (9, 0)}
#: TrainConfig.amp of a dtype; the mixed-precision mode a lab uses where it says "AMP".
AMP_OF_DTYPE = {"float32": "none", "bfloat16": "bf16", "float16": "fp16"}
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
    from labkit.runtime.envinfo import BF16_CAPABILITY

    want = "bfloat16" if CAPABILITY[family] >= BF16_CAPABILITY else "float16"
    if profile.dtype != want:
        return (f"profile {profile.name!r}: dtype {profile.dtype} on {family} (compute capability "
                f"{'.'.join(map(str, CAPABILITY[family]))}); use {want}")
    return None


def lab_runs(profile: Profile) -> list[tuple[str, str, str, str, dict]]:
    """(lab, label, strategy, model, options) of every training run the lab notebooks make on `profile`,
    with the precision and ranks each run states: what a rehearsal of the notebooks observed
    (`labkit.course.rehearse.MANIFEST`, checked against a fresh rehearsal by tests/test_rehearsal.py),
    not a hand-kept list. A lesson's deliberate out-of-memory runs (`may_oom`) and runs a lesson puts on a
    CPU profile (09's multi-rank runs on a one-GPU node: the manifest names their `profile`) are left out."""
    from labkit.course import rehearse

    if profile.device == "cpu":  # nothing to size against a GPU: the notebooks' own runs in make test train them
        return []
    return [(r["lab"], r["label"], r["strategy"], r["model"], dict(r["options"]))
            for r in rehearse.manifest_rows(profile.name) if not r.get("may_oom") and "profile" not in r]


def capacity(profile: Profile) -> float | None:
    """Bytes the estimate may use on one of the profile's GPUs; None on CPU."""
    return runs.capacity(profile)


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
    cap = runs.capacity(profile, cfg.memory.memory_cap_gb)
    if cap is None:
        return Item(ok=True, **item)
    try:
        used = estimate(memory_config(cfg)).total
    except ConfigError as exc:
        return Item(ok=False, reason=f"the estimator cannot size this run: {exc}", **item)
    if used > cap:
        return Item(ok=False, bytes_per_gpu=used, capacity=cap, **item,
                    reason=f"estimated {used / 1e9:.1f} GB per GPU > {HEADROOM:.0%} of "
                           f"{cfg.memory.memory_cap_gb or profile.gpu_memory_gb:g} GB; "
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
