"""Typed facts a `RunRecord` carries beside its common numbers, one small frozen dataclass per topic.

A strategy's `record_facts()` returns `{"<group>": <Facts>}` (e.g. `{"comm": CommFacts(all_reduce=...)}`)
and the training loop adds `train`. A notebook reads attributes: `record.comm.total`,
`record.pipeline.bubble_measured`, `record.peft.trainable_fraction`; a misspelled name raises
AttributeError at once, and a group the strategy does not record is None (`record.pipeline` of a DDP
run), so `record.pipeline.bubble_measured` fails loudly instead of reading a silent None.

`GROUPS` maps each RunRecord field to its class; `from_legacy` turns the flat `extra` dict of schema-1
records (results JSONL and sealed notebook payloads written before the typed facts) into groups.
Introduced in notebook 02_single_gpu (`record.train.epoch_time_s`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from labkit.errors import ConfigError


@dataclass(frozen=True)
class TrainFacts:
    """What the training loop knew and measured (every run; accelerate runs fill `run_id` only)."""

    run_id: str | None = None
    device_name: str | None = None
    amp: str | None = None
    accum: int = 1
    micro_batch: int | None = None
    """Samples per rank per forward: global batch / dp_size / accum."""
    dp_size: int = 1
    lr: float | None = None
    activation_checkpointing: bool = False
    channels_last: bool = False
    compile: bool = False
    data: str | None = None
    seed: int = 0
    dataset_size: int | None = None
    steps_per_epoch: int | None = None
    epoch_time_s: float | None = None
    """steps_per_epoch x the median step time: the projected time of one pass over the data."""
    cpu_step_time_s: list[float] = field(default_factory=list)
    """Per rank: median CPU-seconds of a steady step (`time.process_time`, all threads of the rank).
    Unlike the wall clock, other processes on a shared CPU hardly change it (labkit.train.metrics.cpu_share)."""
    flops_per_step: float | None = None
    achieved_tflops: float | None = None
    peak_tflops_per_device: float | None = None
    resumed_from: int | None = None
    """The step a resumed run started from (None: trained from scratch)."""
    stopped: str | None = None
    """Why a run ended before `steps` ('deadline'), None when it ran them all."""
    checkpoint_save_s: list[float] = field(default_factory=list)
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    eval_start_loss: float | None = None
    """Held-out loss before the first step (`--eval-at-start`): did fine-tuning help?"""
    eval_start_accuracy: float | None = None
    trace_steps: int = 0
    profile_dir: str | None = None
    """Where the profiler wrote this run's traces (None when no step was traced)."""


@dataclass(frozen=True)
class CommFacts:
    """Bytes each rank sends per optimizer step, by collective (ring algorithms, modeled from tensor sizes)."""

    all_reduce: int = 0
    all_gather: int = 0
    reduce_scatter: int = 0
    all_to_all: int = 0
    send_recv: int = 0
    bucket_cap_mb: int | None = None
    """DDP's gradient bucket size (None: no buckets)."""

    @property
    def total(self) -> int:
        """All bytes a rank sends per step, every collective together."""
        return self.all_reduce + self.all_gather + self.reduce_scatter + self.all_to_all + self.send_recv

    @classmethod
    def of(cls, by_collective: dict[str, int], **more) -> "CommFacts":
        """From a `{collective: bytes}` dict (the comm formulas' shape); unknown names are errors."""
        return build(cls, {**by_collective, **more})


@dataclass(frozen=True)
class OptimizerFacts:
    name: str | None = None
    paged: bool = False
    """Paged for real (CUDA unified memory); False on CPU, where bitsandbytes cannot page."""
    state_bits: dict[str, int] = field(default_factory=dict)
    """Parameters per optimizer-state width: {'32': n, '8': m}."""


@dataclass(frozen=True)
class ShardingFacts:
    """How FSDP (fields mesh_shape .. memory_efficient_loading) or DeepSpeed ZeRO (zero_stage ..) sharded."""

    mesh_shape: list[int] | None = None
    mesh_dims: list[str] | None = None
    reshard_after_forward: bool | None = None
    wrap_policy: str | None = None
    fsdp_units: int | None = None
    unit_params: list[int] | None = None
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    master_dtype: str | None = None
    memory_efficient_loading: bool | None = None
    zero_stage: int | None = None
    ds_accelerator: str | None = None
    ds_config: str | None = None
    ds_optimizer: str | None = None


@dataclass(frozen=True)
class MemoryFacts:
    """Where model state lived: offload, the fp32 master copy, what stays gathered after forward."""

    offload: bool = False
    offload_physical: bool = False
    """Moved to another memory for real (False on CPU, where host and device are one memory)."""
    offload_pin_memory: bool | None = None
    param_bytes_after_forward: int | None = None
    master_copy_bytes: int | None = None


@dataclass(frozen=True)
class PipelineFacts:
    pp: int = 1
    schedule: str | None = None
    microbatches: int = 1
    stage_layers: list[list[int]] = field(default_factory=list)
    virtual_stages: int | None = None
    local_stages: list[int] | None = None
    bubble_theory: float | None = None
    bubble_measured: float | None = None
    """Median idle share per stage over the schedule runs after warm-up."""
    bubble_per_stage: list[float] = field(default_factory=list)
    stage_ms: list[float] = field(default_factory=list)
    """Per stage: median ms of compute per micro-batch (forward + backward) over the schedule runs after
    warm-up (`labkit.parallel.comm.stage_times`): how uneven the stages are."""
    max_in_flight: list[int] = field(default_factory=list)
    schedule_trace: list[dict] = field(default_factory=list)
    """The last schedule run's events: dicts with stage, kind 'F'/'B'/'W', mb, t0, t1 (ms)."""


@dataclass(frozen=True)
class TensorFacts:
    tp: int = 1
    dp: int = 1
    mesh: list[int] = field(default_factory=list)
    sequence_parallel: bool = False
    loss_parallel: bool = False
    collectives_first_step: dict[str, int] = field(default_factory=dict)
    """Collectives counted by CommDebugMode in the first step, by name."""
    collectives_tp_design_per_micro_batch: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ContextFacts:
    cp: int = 1
    cp_split: str | None = None
    ring_kv_bytes_per_layer_per_sample: int | None = None


@dataclass(frozen=True)
class ExpertFacts:
    ep: int = 1
    experts_per_rank: int | None = None
    moe_layers: int | None = None
    expert_param_bytes: int | None = None
    expert_param_bytes_all_ranks: int | None = None


@dataclass(frozen=True)
class PeftFacts:
    """LoRA (rank .. adapter_path) and QLoRA / FSDP-QLoRA quantization (quant_type ..)."""

    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float | None = None
    lora_targets: list[str] | None = None
    trainable_fraction: float | None = None
    total_params: int | None = None
    lora_parallel: str | None = None
    adapter_bytes: int | None = None
    adapter_path: str | None = None
    quant_type: str | None = None
    double_quant: bool | None = None
    compute_dtype: str | None = None
    quant_blocksize: int | None = None
    quant_storage: str | None = None
    weight_bytes: dict[str, int] | None = None
    weight_ratio_vs_bf16: float | None = None
    packed_4bit_full_bytes: int | None = None
    packed_4bit_rank_bytes: int | None = None
    quant_state_bytes_replicated: int | None = None


@dataclass(frozen=True)
class AccelerateFacts:
    """What `accelerate launch` really built (notebook 04): never what was asked for."""

    requested_strategy: str | None = None
    accelerate_config: str | None = None
    peak_measured: bool = False
    requested_fsdp: bool = False
    distributed_type: str | None = None
    wrapper: str | None = None
    fsdp_effective: bool = False
    silently_replaced: bool = False
    mixed_precision: str | None = None


#: RunRecord field -> its facts class.
GROUPS: dict[str, type] = {"train": TrainFacts, "comm": CommFacts, "optim": OptimizerFacts,
                           "sharding": ShardingFacts, "memory": MemoryFacts, "pipeline": PipelineFacts,
                           "tensor": TensorFacts, "context": ContextFacts, "expert": ExpertFacts,
                           "peft": PeftFacts, "accelerate": AccelerateFacts}


def build(cls: type, data: dict[str, Any]):
    """`cls(**data)`, with unknown names reported as one line that names them and the class."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} fields {unknown}; known: {', '.join(sorted(known))}")
    return cls(**data)


# ------------------------------------------------------------------------------------ schema 1
#: Flat `extra` keys of schema-1 records whose name differs from their field: key -> (group, field).
_RENAMED = {"optimizer": ("optim", "name"), "optimizer_paged": ("optim", "paged"),
            "optimizer_state_bits": ("optim", "state_bits"), "allreduce_bytes_per_rank": ("comm", "all_reduce")}


def _legacy_keys() -> dict[str, tuple[str, str]]:
    keys: dict[str, tuple[str, str]] = {}
    for group, cls in GROUPS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in keys, f"facts field {f.name!r} in two groups: legacy keys would be ambiguous"
            keys[f.name] = (group, f.name)
    return {**keys, **_RENAMED}


LEGACY_KEYS = _legacy_keys()


def from_legacy(extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(groups, notes) of a schema-1 record's flat `extra`: `{"comm": CommFacts, ...}` and the keys no
    group knows (kept as free-form notes, so nothing an old file holds is dropped)."""
    grouped: dict[str, dict[str, Any]] = {}
    notes = {}
    for key, value in extra.items():
        if key == "comm_bytes_per_rank":  # FSDP / ZeRO: {collective: bytes}
            grouped.setdefault("comm", {}).update(value or {})
        elif key == "dp" and "tp" not in extra:
            continue  # context parallel's dp (always 1) repeats train.dp_size
        elif key in LEGACY_KEYS:
            group, name = LEGACY_KEYS[key]
            grouped.setdefault(group, {})[name] = value
        else:
            notes[key] = value
    return {group: build(GROUPS[group], values) for group, values in grouped.items()}, notes
