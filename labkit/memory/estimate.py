"""Will it fit? Per-GPU training memory from first principles (pure Python; no torch import).

`estimate(MemoryConfig(...))` sums four parts per GPU — weights, gradients, optimizer states and
activations — never their maximum. Accounting conventions (stated here and in docs/memory.md):

- Model states follow the ZeRO paper (Rajbhandari et al. 2020, Sec. 3.1): mixed precision with Adam
  keeps 2 B low-precision weights + 2 B gradients + K = 12 B (fp32 master weights, momentum,
  variance) per parameter = 16 B; fp32 Adam keeps 4 + 4 + 8 = 16 B, which is exactly what
  `torch.optim.AdamW` allocates (param, grad, exp_avg, exp_avg_sq). Pure bf16/fp16 keeps the
  optimizer states in the parameter dtype, as torch does.
- ZeRO stages (Sec. 5.1-5.3) divide optimizer states (1), then gradients (2), then weights (3) by
  the data-parallel degree N_d; FSDP full_shard = 3, shard_grad_op = 2, no_shard = 0, hybrid_shard =
  3 within a node (Zhao et al. 2023, Sec. 3.2.2).
- Tensor / pipeline parallelism split the weights of a stage (Shoeybi et al. 2019; Narayanan et al.
  2021); we report the busiest pipeline stage.
- 8-bit Adam keeps each state in 1 B plus one fp32 absmax per 256-element block (Dettmers et al.
  2022, "8-bit Optimizers via Block-wise Quantization", Sec. 2).
- NF4 stores 4 bits + one fp32 absmax per 64 weights; double quantization stores that absmax in
  8 bits with one fp32 constant per 256 blocks: 4 + 8/64 + 32/(64*256) = 4.127 bits (QLoRA, Dettmers
  et al. 2023, Sec. 3). LLM.int8 stores 1 B + one fp32 scale per output row. Embeddings, norms and
  the LM head stay 16-bit.
- LoRA (Hu et al. 2022) trains r*(d_in + d_out) parameters per targeted linear; the frozen base
  needs no gradients, optimizer states or master copy.
- Offload follows ZeRO-Offload (Ren et al. 2021) / ZeRO-Infinity (Rajbhandari et al. 2021).
- Context parallelism (cp, ring attention) splits every sequence over cp GPUs: activations are those
  of seq/cp tokens plus the K/V blocks received from the other cp - 1 ranks, kept for backward.
  Expert parallelism (ep, GShard) splits the experts of an MoE model over ep of the dp ranks: expert
  weights, gradients and optimizer states / ep (ZeRO already shards them over N_d when it applies).
Introduced in notebook 01_memory.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass

from labkit.errors import ConfigError, choices_error
from labkit.memory import activations as act
from labkit.memory.params import FUSED_SLICES, ModelSpec, lora_units, model_spec, params_spec
from labkit.parallel.dims import ParallelDims

#: precision -> (bytes per weight and per gradient, bytes of the fp32 master copy)
PRECISIONS = {"fp32": (4, 0), "bf16": (2, 0), "fp16": (2, 0), "mixed-bf16": (2, 4), "mixed-fp16": (2, 4)}
#: optimizer -> number of per-parameter state tensors
OPTIMIZERS = {"adamw": 2, "sgd": 0, "sgd-momentum": 1, "adamw-8bit": 2, "paged-adamw-8bit": 2}
EIGHT_BIT = ("adamw-8bit", "paged-adamw-8bit")
BNB_BLOCK = 256  # bitsandbytes' block size for 8-bit optimizer states
FSDP_STRATEGIES = {"full_shard": 3, "shard_grad_op": 2, "no_shard": 0, "hybrid_shard": 3}
OFFLOADS = ("none", "optimizer", "optimizer+params")
QUANTS = ("none", "int8", "nf4", "nf4-dq")
CHECKPOINTING = ("none", "selective", "full")
LORA_ALIASES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
                "up": "up_proj", "down": "down_proj"}
DEFAULT_SEQ = 2048
#: With only a parameter count, the largest unit ZeRO-3 gathers is assumed to be one transformer layer
#: of a 32-layer model (Llama-2-7B, GPT-3 2.7B/6.7B: Brown et al. 2020, Table 2.1): params / 32.
ASSUMED_LAYERS = 32


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


@dataclass(frozen=True)
class Estimate:
    """Bytes on one GPU (and in host memory) for one training step."""

    params: int
    trainable_params: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    total: int
    """Estimate: the sum of the four parts. Trace / measure: the observed peak."""
    cpu_bytes: int = 0
    """Host memory for this GPU's rank (offloaded states)."""
    assumptions: tuple = ()
    source: str = "estimate"

    @property
    def model_states(self) -> int:
        return self.weights + self.grads + self.optimizer

    def to_dict(self) -> dict:
        parts = {k: int(getattr(self, k)) for k in ("weights", "grads", "optimizer", "activations", "total")}
        return {"params": int(self.params), "trainable_params": int(self.trainable_params),
                "per_gpu_bytes": parts, "cpu_bytes": int(self.cpu_bytes),
                "assumptions": [str(a) for a in self.assumptions]}

    def to_json(self) -> str:
        """The `--json` layout: params, trainable_params, per_gpu_bytes{...}, cpu_bytes, assumptions."""
        return json.dumps(self.to_dict())

    def fits(self, capacity_bytes: float) -> bool:
        return self.total <= capacity_bytes


@functools.lru_cache(maxsize=64)
def _spec(model: str) -> ModelSpec:
    return model_spec(model)


def spec_of(cfg: MemoryConfig) -> ModelSpec:
    return _spec(cfg.model) if cfg.model is not None else params_spec(cfg.params)


def lora_params(spec: ModelSpec, cfg: MemoryConfig) -> int:
    """r * (d_in + d_out) per targeted linear (Hu et al. 2022, Sec. 4.1): peft's trainable count."""
    if not spec.linears:
        raise ConfigError(f"LoRA needs the linear layers of the model; {spec.name!r} ({spec.kind}) has none "
                          "modelled: use an LLM preset or a Llama-style config.json")
    units = lora_units(spec)
    targets = set(lora_targets(spec, cfg))
    unknown = sorted(targets - set(units))
    if unknown:
        raise ConfigError(f"unknown LoRA target(s) {unknown} for {spec.name}; valid targets are: "
                          f"{', '.join(sorted(units))} (or all-linear)")
    for fused, slices in FUSED_SLICES.items():
        both = sorted(targets & set(slices))
        if fused in targets and both:
            raise ConfigError(f"LoRA targets {fused!r} and {both} overlap ({fused} is the fused {','.join(slices)}); "
                              f"give {fused} or its slices, not both")
    return sum(cfg.lora_rank * (units[t].fan_in + units[t].fan_out) * units[t].count for t in targets)


def _quant_bytes(spec: ModelSpec, quant: str, wb: int) -> int:
    """Bytes of the frozen base with its block linears quantized, the rest at `wb` bytes."""
    if quant == "none":
        return spec.params * wb
    quantized, total = 0, 0
    for lin in spec.linears:
        n = lin.fan_in * lin.fan_out
        if quant == "int8":
            per = n + 4 * lin.fan_out  # int8 weights + fp32 row scale (LLM.int8, Dettmers et al. 2022)
        elif quant == "nf4":
            per = n // 2 + 4 * math.ceil(n / 64)
        else:  # nf4-dq: 8-bit absmax per 64, fp32 constant per 256 absmax blocks (QLoRA Sec. 3)
            per = n // 2 + math.ceil(n / 64) + 4 * math.ceil(n / (64 * 256))
        quantized, total = quantized + n * lin.count, total + per * lin.count
    return total + (spec.params - quantized) * wb


def _share(spec: ModelSpec, cfg: MemoryConfig) -> float:
    """Fraction of the model's weights on the busiest GPU under tp x pp (norms split too: approx.)."""
    if cfg.tp == 1 and cfg.pp == 1:
        return 1.0
    if spec.kind == "vision":
        raise ConfigError("tensor/pipeline parallelism is modelled for transformer presets; "
                          "use dp (with zero) for ResNet")
    if spec.kind == "params" or not spec.num_blocks:
        return 1.0 / (cfg.tp * cfg.pp)
    layers = math.ceil(spec.num_blocks / cfg.pp) * spec.block
    tied = spec.arch.get("tied") and cfg.pp > 1  # Megatron keeps a copy of the tied embedding last
    first = spec.embed + layers + (spec.head if cfg.pp == 1 else 0)
    last = layers + spec.head + (spec.embed if tied else 0)
    return max(first, last) / spec.params / cfg.tp


def _states(spec: ModelSpec, cfg: MemoryConfig) -> tuple[dict, int, list]:
    """Whole-model bytes of weights / grads / optimizer before any sharding, and the trainable count."""
    wb, master = PRECISIONS[cfg.precision]
    if cfg.optimizer in EIGHT_BIT:
        slot = 1 + 4 / BNB_BLOCK
    else:
        slot = 4 if (master or cfg.precision == "fp32") and cfg.optimizer_states == "fp32" else wb
    per_trainable = master + OPTIMIZERS[cfg.optimizer] * slot
    buffers = spec.buffers * wb
    notes = [f"{cfg.precision} + {cfg.optimizer}: {wb} B weights + {wb} B grads + {per_trainable:g} B "
             "optimizer per trainable parameter" + (" (ZeRO paper, K=12)" if per_trainable == 12 else "")]
    if cfg.lora_rank:
        trainable = lora_params(spec, cfg)
        base = _quant_bytes(spec, cfg.quant, wb)
        notes.append(f"LoRA r={cfg.lora_rank} on {','.join(cfg.lora_targets)}: {trainable:,} trainable; "
                     f"frozen base in {cfg.quant if cfg.quant != 'none' else cfg.precision} = {base:,} B")
        weights = base + trainable * wb + buffers
    else:
        trainable = spec.params
        weights = spec.params * wb + buffers
    return {"weights": weights, "grads": trainable * wb, "optimizer": trainable * per_trainable}, trainable, notes


def _shard(parts: dict, spec: ModelSpec, cfg: MemoryConfig, trainable: int, notes: list) -> int:
    """Apply tp/pp, then ZeRO over the data-parallel group, then offload. Returns cpu bytes."""
    share = _share(spec, cfg)
    if share != 1.0:
        notes.append(f"tp={cfg.tp} x pp={cfg.pp}: this GPU holds {share:.4f} of the weights (busiest stage)")
    nd = (cfg.zero_group or cfg.dp) * cfg.cp  # cp ranks hold the same weights: ZeRO shards over dp x cp
    experts = _expert_fraction(spec, cfg, notes)
    for key, stage in (("optimizer", 1), ("grads", 2), ("weights", 3)):
        divisor = nd if cfg.zero >= stage else 1
        if key == "weights":  # expert weights stay at the compute width (not nn.Linear: never quantized)
            frac = spec.expert_params * PRECISIONS[cfg.precision][0] / parts[key] if experts else 0.0
        else:  # LoRA: experts frozen, no gradients or states
            frac = 0.0 if cfg.lora_rank else experts
        # dense part / ZeRO's N_d; expert part / ep, or / N_d when ZeRO shards it over all dp ranks anyway
        parts[key] = math.ceil(parts[key] * share * ((1 - frac) / divisor + frac / max(divisor, cfg.ep)))
    if cfg.zero:
        notes.append(f"ZeRO-{cfg.zero} over N_d={nd} ranks" + (f" (dp x cp={cfg.cp})" if cfg.cp > 1 else "") +
                     (f" (hybrid: replicated over {cfg.dp * cfg.cp // nd} groups)" if nd != cfg.dp * cfg.cp else ""))
    cpu = 0
    if cfg.offload != "none":
        # ZeRO-Offload: fp32 master + moments live on the host with an fp32 gradient copy for CPU Adam.
        grads_fp32 = math.ceil(trainable * share / nd) * 4 if cfg.zero >= 2 else math.ceil(trainable * share) * 4
        cpu, parts["optimizer"] = parts["optimizer"] + grads_fp32, 0
        notes.append("offload optimizer: states + an fp32 gradient copy in host memory")
    if cfg.offload == "optimizer+params":
        wb = PRECISIONS[cfg.precision][0]
        cpu += parts["weights"] + parts["grads"]
        layer = math.ceil(largest_layer(spec, cfg, notes) * share)  # one gathered unit stays on the GPU
        parts["weights"] = layer * wb
        parts["grads"] = min(layer, trainable) * wb
        notes.append(f"offload params: GPU keeps one gathered layer ({layer:,} params) of weights and grads")
    return cpu


def _expert_fraction(spec: ModelSpec, cfg: MemoryConfig, notes: list) -> float:
    """Share of the parameters that are MoE experts (what ep splits); ConfigError for ep on a dense model."""
    if cfg.ep > 1 and not spec.expert_params:
        raise ConfigError(f"ep={cfg.ep} splits mixture-of-experts experts; {spec.name!r} has none: "
                          "use ep=1, or an MoE model such as tiny-moe")
    if cfg.ep > 1:
        notes.append(f"ep={cfg.ep}: each GPU holds 1/{cfg.ep} of the experts ({spec.expert_params:,} parameters)")
    return spec.expert_params / spec.params if spec.expert_params else 0.0  # of the trainable parameters


def largest_layer(spec: ModelSpec, cfg: MemoryConfig, notes: list) -> int:
    """Parameters of the largest unit gathered at once: given, from the model, or assumed (noted)."""
    if cfg.largest_layer is not None:
        notes.append(f"largest gathered layer: {cfg.largest_layer:,} params (given)")
        return min(cfg.largest_layer, spec.params)
    if spec.kind == "params":
        layer = math.ceil(spec.params / ASSUMED_LAYERS)
        notes.append(f"largest gathered layer ASSUMED = params / {ASSUMED_LAYERS} = {layer:,} (one layer of a "
                     f"{ASSUMED_LAYERS}-layer transformer); give --largest-layer N (or --model) for yours")
        return layer
    return spec.largest_layer


def _activations(spec: ModelSpec, cfg: MemoryConfig, notes: list) -> int:
    if cfg.batch is None:
        notes.append("no batch given: activations 0 (model states only)")
        return 0
    if spec.kind == "params":
        raise ConfigError("activations need a model architecture: use --model PRESET or a Llama-style "
                          "config.json instead of --params, or drop --batch")
    micro = cfg.batch // cfg.grad_accum
    e = 4 if cfg.precision == "fp32" else 2
    if spec.kind == "vision":
        if cfg.checkpointing != "none" or cfg.lora_rank:
            raise ConfigError("checkpointing and LoRA are modelled for transformer presets; "
                              "use checkpointing='none' and lora_rank=0 for ResNet")
        notes.append(f"micro-batch {micro} images of {spec.arch['image_size']}px, {e} B activations")
        return act.resnet_bytes(spec.arch, micro, e)
    seq = cfg.seq or min(spec.arch["max_seq"], DEFAULT_SEQ)
    if seq % cfg.cp:
        raise ConfigError(f"seq={seq} does not split into cp={cfg.cp} equal chunks; use a multiple of {cfg.cp}")
    ring = 0
    if cfg.cp > 1:  # this GPU's seq/cp tokens, plus the other chunks' K/V kept for backward
        seq //= cfg.cp
        a = spec.arch
        ring = (cfg.cp - 1) * 2 * micro * seq * a["kv_heads"] * a["head_dim"] * e * math.ceil(a["layers"] / cfg.pp)
        notes.append(f"cp={cfg.cp}: {seq} tokens of each sequence per GPU + {ring:,} B of ring K/V blocks")
    step = act.Step(micro_batch=micro, seq=seq, act_bytes=e, checkpointing=cfg.checkpointing,
                    flash=cfg.flash_attention, tp=cfg.tp, sp=cfg.sequence_parallel and cfg.tp > 1,
                    pp=cfg.pp, n_micro=cfg.grad_accum, fused=cfg.fused_kernels, fused_loss=cfg.fused_loss,
                    lora_targets=frozenset(lora_targets(spec, cfg)), lora_rank=cfg.lora_rank)
    notes.append(f"micro-batch {micro} x seq {seq}, {e} B activations, checkpointing {cfg.checkpointing}, "
                 f"{'flash/SDPA' if cfg.flash_attention else 'eager'} attention"
                 + (", 1F1B pipeline: busiest stage" if cfg.pp > 1 else ""))
    return act.transformer_bytes(spec.arch, step, gpt=spec.kind == "gpt") + ring


def lora_targets(spec: ModelSpec, cfg: MemoryConfig) -> tuple:
    if not cfg.lora_rank:
        return ()
    if "all-linear" in cfg.lora_targets:
        return tuple(lin.name for lin in spec.linears)
    return cfg.lora_targets


def estimate(cfg: MemoryConfig, *, spec: ModelSpec | None = None) -> Estimate:
    """Per-GPU bytes of weights, grads, optimizer states and activations; total = their sum.
    `spec` stands in for `cfg.model` when the model is not a file or preset (a published run's table row)."""
    spec = spec or spec_of(cfg)
    parts, trainable, notes = _states(spec, cfg)
    cpu = _shard(parts, spec, cfg, trainable, notes)
    activations = _activations(spec, cfg, notes)
    if cfg.batch is not None and cfg.dp > 1:
        notes.append(f"global batch = {cfg.batch} x dp {cfg.dp} = {cfg.batch * cfg.dp} samples per step")
    notes.append("total = weights + grads + optimizer + activations (sum, not max); "
                 "excludes the CUDA context and allocator fragmentation; GB = 10^9 B, GiB = 2^30 B")
    all_params = spec.params + (trainable if cfg.lora_rank else 0)
    return Estimate(params=all_params, trainable_params=trainable, activations=activations,
                    total=sum(parts.values()) + activations, cpu_bytes=cpu, assumptions=tuple(notes), **parts)
