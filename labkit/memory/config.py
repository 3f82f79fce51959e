"""What a memory estimate is asked: `MemoryConfig`, one training setup (model or parameter count,
precision, optimizer, ZeRO / FSDP sharding, tp x pp x cp x ep, offload, LoRA and quantization, batch and
sequence, checkpointing), validated when it is made, and the choices each field accepts. Every error
names the bad value and the fix. `labkit.memory.estimate` turns a config into bytes (and keeps
`MemoryConfig` and `check_topology` importable, as the notebooks and docs/memory.md import them).
Introduced in notebook 01_memory.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from labkit.errors import ConfigError, choices_error
from labkit.parallel.dims import ParallelDims

#: precision -> (bytes per weight and per gradient, bytes of the fp32 master copy)
PRECISIONS = {"fp32": (4, 0), "bf16": (2, 0), "fp16": (2, 0), "mixed-bf16": (2, 4), "mixed-fp16": (2, 4)}
#: optimizer -> number of per-parameter state tensors
OPTIMIZERS = {"adamw": 2, "sgd": 0, "sgd-momentum": 1, "adamw-8bit": 2, "paged-adamw-8bit": 2}
FSDP_STRATEGIES = {"full_shard": 3, "shard_grad_op": 2, "no_shard": 0, "hybrid_shard": 3}
OFFLOADS = ("none", "optimizer", "optimizer+params")
QUANTS = ("none", "int8", "nf4", "nf4-dq")
CHECKPOINTING = ("none", "selective", "full")
LORA_ALIASES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
                "up": "up_proj", "down": "down_proj"}


def _positive(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r}; it must be a positive integer")


def check_topology(dp: int, tp: int, pp: int, gpus: int, cp: int = 1) -> None:
    """Raise ConfigError unless dp * tp * pp (* cp) == gpus, naming the product (labkit.parallel.dims)."""
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("gpus", gpus), ("cp", cp)):
        _positive(name, value)
    ParallelDims(dp_shard=dp, tp=tp, pp=pp, cp=cp).check_world(gpus, label="gpus")


@dataclass(frozen=True)
class MemoryConfig:
    """One training setup to estimate. Exactly one of `model` / `params` is given."""

    model: str | None = None
    """Preset name (`labkit.zoo.presets`) or path of a Hugging Face config.json."""
    params: int | None = None
    """A bare parameter count instead of a model (model states only)."""
    precision: str = "mixed-bf16"
    """fp32, bf16, fp16 (pure: states in that dtype), mixed-bf16, mixed-fp16 (fp32 master, ZeRO)."""
    optimizer: str = "adamw"
    """adamw, sgd, sgd-momentum, adamw-8bit, paged-adamw-8bit."""
    optimizer_states: str = "fp32"
    """Adam's moments in fp32 or bf16 (Megatron's precision-aware optimizer, NeMo's large recipes); mixed only."""
    fused_loss: bool = False
    """A fused cross-entropy keeps only the compute-dtype logits (`labkit.memory.activations.Step.fused_loss`)."""
    zero: int = 0
    """ZeRO stage 0-3 over the data-parallel group."""
    zero_group: int = 0
    """Ranks ZeRO shards over; 0 = all dp ranks; a node size for FSDP hybrid_shard."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    gpus: int | None = None
    """If given, must equal dp * tp * pp * cp."""
    cp: int = 1
    """Context-parallel degree: GPUs one sequence is split over (ring attention)."""
    ep: int = 1
    """Expert-parallel degree (MoE models): dp ranks the experts are split over; divides dp."""
    offload: str = "none"
    """none, optimizer (ZeRO-Offload, needs zero >= 1) or optimizer+params (ZeRO-Infinity, zero 3)."""
    lora_rank: int = 0
    """0 = full fine-tune; r > 0 = LoRA of rank r on a frozen base."""
    lora_targets: tuple = ("q_proj", "v_proj")
    """Linear-layer names LoRA adapts ('q', 'v' and 'all-linear' are accepted; q/k/v also on a fused qkv)."""
    quant: str = "none"
    """Base-weight quantization with LoRA: none, int8, nf4, nf4-dq (double quantization)."""
    batch: int | None = None
    """Samples per GPU per optimizer step; None = model states only (activations 0)."""
    seq: int | None = None
    """Tokens per sequence (LLMs); None = min(model context, 2048)."""
    grad_accum: int = 1
    """Gradient-accumulation steps: the batch runs as `grad_accum` micro-batches."""
    checkpointing: str = "none"
    """Activation checkpointing: none, selective (attention core) or full (every layer)."""
    flash_attention: bool = True
    """Fused (flash/SDPA) attention: no (b, heads, s, s) matrices are kept."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (splits the norm regions over tp too)."""
    fused_kernels: bool = False
    """Activations as fused RMSNorm / SwiGLU kernels save them (Megatron-LM, Meta's and torchtitan's compiled
    runs: `labkit.memory.activations.Step.fused`); False = Hugging Face's eager modules, what the course trains."""
    largest_layer: int | None = None
    """Parameters of the largest unit ZeRO-3 gathers at once (offloaded params); None = the model's
    largest block / embedding, or params / ASSUMED_LAYERS when only a count is given."""

    def __post_init__(self) -> None:
        if (self.model is None) == (self.params is None):
            raise ConfigError(f"give exactly one of model= (a preset or config.json) or params= "
                              f"(got model={self.model!r}, params={self.params!r})")
        if self.params is not None:
            _positive("params", self.params)
        for name, valid in (("precision", PRECISIONS), ("optimizer", OPTIMIZERS), ("offload", OFFLOADS),
                            ("quant", QUANTS), ("checkpointing", CHECKPOINTING),
                            ("optimizer_states", ("fp32", "bf16"))):
            if getattr(self, name) not in valid:
                raise choices_error(name, getattr(self, name), valid)
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise choices_error("zero stage", self.zero, ("0", "1", "2", "3"))
        for name in ("dp", "tp", "pp", "cp", "ep", "grad_accum"):
            _positive(name, getattr(self, name))
        for name in ("gpus", "batch", "seq", "largest_layer"):
            _positive(name, getattr(self, name), allow_none=True)
        if self.gpus is not None:
            check_topology(self.dp, self.tp, self.pp, self.gpus, self.cp)
        self._check_sharding()
        _ = self.dims  # ParallelDims validates the degrees: ep must divide dp
        self._check_lora()
        if self.batch is not None and self.batch % self.grad_accum:
            raise ConfigError(f"batch={self.batch} is not divisible by grad_accum={self.grad_accum}; "
                              "the batch is split into grad_accum equal micro-batches")
        for name in ("flash_attention", "sequence_parallel", "fused_kernels"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r}; use True or False")

    def _check_sharding(self) -> None:
        if not isinstance(self.zero_group, int) or self.zero_group < 0 or (
                self.zero_group and self.dp % self.zero_group):
            raise ConfigError(f"zero_group={self.zero_group!r} must be 0 (all dp ranks) or divide dp={self.dp}")
        if self.offload == "optimizer" and self.zero < 1:
            raise ConfigError("offload='optimizer' is ZeRO-Offload: it needs zero >= 1 "
                              "(DeepSpeed's offload_optimizer lives in zero_optimization); add --zero 2")
        if self.offload == "optimizer+params" and self.zero != 3:
            raise ConfigError(f"offload='optimizer+params' needs zero=3 (got zero={self.zero}): "
                              "only stage 3 partitions the parameters it offloads; use --zero 3")

    def _check_lora(self) -> None:
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ConfigError(f"lora_rank={self.lora_rank!r}; use 0 (full fine-tune) or a positive rank like 8")
        targets = (self.lora_targets.split(",") if isinstance(self.lora_targets, str) else self.lora_targets)
        targets = tuple(sorted({LORA_ALIASES.get(t.strip(), t.strip()) for t in targets if t.strip()}))
        if self.lora_rank and not targets:
            raise ConfigError("lora_targets is empty; name the linear layers to adapt, e.g. q,v")
        object.__setattr__(self, "lora_targets", targets)
        if self.quant != "none" and not self.lora_rank:
            raise ConfigError(f"quant={self.quant!r} freezes the base in {self.quant}: quantized weights "
                              "cannot be trained directly; add a LoRA rank (QLoRA), e.g. --lora-rank 8")

    @property
    def dims(self) -> ParallelDims:
        """The topology: ZeRO (zero >= 1) shards over zero_group ranks (all dp ranks when 0) and
        replicates over the rest (FSDP hybrid_shard); without ZeRO every dp rank is a replica."""
        shard = (self.zero_group or self.dp) if self.zero else 1
        return ParallelDims(dp_replicate=self.dp // shard, dp_shard=shard, tp=self.tp, pp=self.pp, cp=self.cp,
                            ep=self.ep)

    @classmethod
    def for_fsdp(cls, strategy: str, *, node_size: int = 0, **fields) -> "MemoryConfig":
        """A config for a torch FSDP sharding strategy (hybrid_shard shards within `node_size` ranks)."""
        if strategy not in FSDP_STRATEGIES:
            raise choices_error("FSDP sharding strategy", strategy, FSDP_STRATEGIES)
        group = 0
        if strategy == "hybrid_shard":
            _positive("node_size", node_size)
            group = node_size
        return cls(zero=FSDP_STRATEGIES[strategy], zero_group=group, **fields)

    def replace(self, **changes) -> "MemoryConfig":
        return dataclasses.replace(self, **changes)
