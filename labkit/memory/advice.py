"""Which single change makes it fit? Tries the course's memory levers one at a time (pure Python).

The levers, cheapest in speed first: flash attention, gradient accumulation (a smaller micro-batch),
activation checkpointing, bf16 instead of fp32 or mixed precision, 8-bit Adam, ZeRO-3 / FSDP
full_shard over the data-parallel ranks, LoRA, QLoRA, then ZeRO-Offload / ZeRO-Infinity.
Introduced in notebook 01_memory.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.errors import ConfigError
from labkit.memory.estimate import Estimate, MemoryConfig, estimate


@dataclass(frozen=True)
class Fix:
    """One change to a config and what it gives."""

    label: str
    config: MemoryConfig
    estimate: Estimate


def _candidates(cfg: MemoryConfig) -> list[tuple[str, dict]]:
    out: list[tuple[str, dict]] = []
    if cfg.batch is not None:
        if not cfg.flash_attention:
            out.append(("flash attention", dict(flash_attention=True)))
        micro = cfg.batch // cfg.grad_accum
        if micro > 1:
            out.append((f"gradient accumulation x{micro} (micro-batch 1)", dict(grad_accum=cfg.batch)))
        if cfg.checkpointing != "full":
            out.append(("full activation checkpointing", dict(checkpointing="full")))
    if cfg.precision != "bf16":
        out.append(("pure bf16 (no fp32 master copy)", dict(precision="bf16")))
    if cfg.optimizer == "adamw":
        out.append(("8-bit AdamW (bitsandbytes)", dict(optimizer="adamw-8bit")))
    if cfg.dp > 1 and cfg.zero < 3:
        out.append((f"ZeRO-3 / FSDP full_shard over {cfg.dp} ranks", dict(zero=3)))
    if not cfg.lora_rank:
        out.append(("LoRA r=8 on q,v", dict(lora_rank=8, lora_targets=("q_proj", "v_proj"))))
        out.append(("QLoRA (nf4 + double quant, LoRA r=8)", dict(lora_rank=8, quant="nf4-dq")))
    elif cfg.quant == "none":
        out.append(("quantize the base to nf4 (QLoRA)", dict(quant="nf4-dq")))
    if cfg.offload == "none":
        out.append(("offload optimizer to CPU (ZeRO-Offload)", dict(offload="optimizer", zero=max(cfg.zero, 1))))
    if cfg.offload != "optimizer+params":
        out.append(("offload optimizer + params (ZeRO-Infinity)", dict(offload="optimizer+params", zero=3)))
    return out


def single_changes(cfg: MemoryConfig) -> list[Fix]:
    """Every applicable one-lever change of `cfg` with its estimate (invalid combinations skipped)."""
    fixes = []
    for label, change in _candidates(cfg):
        try:
            new = cfg.replace(**change)
            fixes.append(Fix(label, new, estimate(new)))
        except ConfigError:  # e.g. LoRA on a ResNet: not a lever for this model
            continue
    return fixes


def what_fits(cfg: MemoryConfig, capacity_bytes: float) -> dict:
    """{'fits', 'total', 'capacity', 'fixes': [labels of single changes that fit, preferred first]}."""
    est = estimate(cfg)
    fixes = [] if est.fits(capacity_bytes) else [
        f.label for f in single_changes(cfg) if f.estimate.fits(capacity_bytes)]
    return {"fits": est.fits(capacity_bytes), "total": est.total, "capacity": int(capacity_bytes), "fixes": fixes}


def verdict(cfg: MemoryConfig, capacity_bytes: float, gpu: str = "the GPU") -> str:
    """One sentence: fits, or the first single change that makes it fit, or that none does."""
    res = what_fits(cfg, capacity_bytes)
    have = f"{res['total'] / 1e9:.1f} GB needed vs {capacity_bytes / 1e9:.1f} GB on {gpu}"
    if res["fits"]:
        return f"fits: {have}"
    if res["fixes"]:
        return f"does not fit ({have}); single change that fits: {res['fixes'][0]}"
    return f"does not fit ({have}); no single change is enough: combine several, or add GPUs"
