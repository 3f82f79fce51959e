"""The estimator's view of a training run: bytes per GPU of a resolved `TrainConfig`, and what a
profile's GPU may hold (`HEADROOM` of its memory).

Used by the preflight's lab check (`labkit.course.profile_check`), by the single-GPU baselines that
need levers to fit (`single_levers` there) and by the rehearsal (`labkit.runtime.rehearsal`), which sizes every
run a notebook makes at its real size before it executes a stand-in. Introduced in notebook 00_setup.
"""
from __future__ import annotations

#: Share of a GPU's memory the estimator's bytes may fill. The rest is the CUDA context (~0.5-1 GB),
#: NCCL buffers, allocator fragmentation and the estimator's own error (docs/memory.md: within ~10%).
HEADROOM = 0.85
#: Estimator precision of each amp mode: torch keeps fp32 master params under autocast (16 B/param
#: with AdamW either way); activations are 2 B in mixed precision.
PRECISION_OF_AMP = {"none": "fp32", "bf16": "mixed-bf16", "fp16": "mixed-fp16"}
#: registry name -> the `labkit.memory.MemoryConfig` fields describing its model states (FSDP by the
#: ZeRO stage its sharding strategy equals, Zhao et al. 2023 Sec. 3.2.2).
ESTIMATE_FIELDS = {
    "single": dict(zero=0), "ddp": dict(zero=0), "fsdp": dict(zero=3), "fsdp-grad-op": dict(zero=2),
    "fsdp-no-shard": dict(zero=0), "fsdp-hybrid": dict(zero=3), "fsdp-offload": dict(zero=3),
    "zero1": dict(zero=1), "zero2": dict(zero=2), "zero3": dict(zero=3),
    "zero3-offload": dict(zero=3, offload="optimizer+params"),
}


def memory_config(cfg):
    """The `labkit.memory.estimate.MemoryConfig` of a resolved TrainConfig (bytes per GPU)."""
    from labkit import parallel
    from labkit.memory.estimate import MemoryConfig
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
    return MemoryConfig(model=cfg.run.model, precision=PRECISION_OF_AMP[cfg.precision.amp], optimizer=optimizer,
                        dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, batch=max(cfg.optim.accum, cfg.optim.batch // dp),
                        grad_accum=cfg.optim.accum, seq=cfg.run.seq_len if cfg.kind == "llm" else None,
                        # ResNet checkpointing is not modelled: its bytes without it are an upper bound.
                        checkpointing="full" if cfg.memory.checkpointing and cfg.kind == "llm" else "none", **fields)


def capacity(profile, cap_gb: float | None = None) -> float | None:
    """Bytes the estimate may use on one of the profile's GPUs (HEADROOM of it, or of a smaller
    `--memory-cap-gb`); None on CPU (no fixed capacity)."""
    if profile.device != "cuda":
        return None
    gpu = profile.gpu_memory_gb * 1e9
    return HEADROOM * (min(gpu, cap_gb * 1e9) if cap_gb else gpu)


def run_bytes(cfg) -> int:
    """The estimator's bytes per GPU of a resolved TrainConfig."""
    from labkit.memory.estimate import estimate

    return estimate(memory_config(cfg)).total
