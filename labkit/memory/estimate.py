"""Will it fit? Per-GPU training memory from first principles (pure Python; no torch import).

`estimate(MemoryConfig(...))` sums four parts per GPU — weights, gradients, optimizer states and
activations — never their maximum (the setup, its choices and their checks: `labkit.memory.config`).
Accounting conventions (stated here and in docs/memory.md):

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

import functools
import json
import math
from dataclasses import dataclass

from labkit.errors import ConfigError
from labkit.memory import activations as act
# MemoryConfig and check_topology stay importable from here: notebook 01, docs/memory.md and the
# notebooks' tests import them with `estimate`
from labkit.memory.config import OPTIMIZERS, PRECISIONS, MemoryConfig, check_topology  # noqa: F401
from labkit.memory.params import FUSED_SLICES, ModelSpec, lora_units, model_spec, params_spec

EIGHT_BIT = ("adamw-8bit", "paged-adamw-8bit")
BNB_BLOCK = 256  # bitsandbytes' block size for 8-bit optimizer states
DEFAULT_SEQ = 2048
#: With only a parameter count, the largest unit ZeRO-3 gathers is assumed to be one transformer layer
#: of a 32-layer model (Llama-2-7B, GPT-3 2.7B/6.7B: Brown et al. 2020, Table 2.1): params / 32.
ASSUMED_LAYERS = 32


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
