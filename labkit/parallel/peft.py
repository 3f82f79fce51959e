"""Parameter-efficient fine-tuning: LoRA and QLoRA strategies (`--strategy lora | qlora`).

LoRA (Hu et al. 2022, "LoRA: Low-Rank Adaptation of Large Language Models"): freeze W (d_out, d_in)
and learn dW = B A with B (d_out, r), A (r, d_in), r << d, scaled by alpha / r; B starts at zero so
training starts from the base model. Only r (d_in + d_out) parameters per adapted linear need
gradients and optimizer state: Llama-2-7B with r=8 on W_q, W_v trains 4.2 M of 6.7 B (0.06 %).
QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"): store the frozen base in
4-bit NormalFloat (NF4, Sec. 3), quantize the per-block absmax constants again (double quantization,
0.127 bits/param), compute in bf16, and page the optimizer state (paged 8-bit AdamW) so memory spikes
spill to host RAM. 7B weights: ~13.5 GB bf16 -> ~3.9 GB.

Both strategies run single-process, or data-parallel over `--nproc N` ranks: DDP by default, FSDP2
with `--lora-parallel fsdp` (lora only). Checkpoints hold only what trains (adapters + optimizer): the
frozen base is rebuilt from its seed or checkpoint. QLoRA's 4-bit base and its strategy live in
`labkit.parallel.qlora`. Introduced in notebook 06_peft.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from labkit.errors import ConfigError
from labkit.parallel.budget import finetune_flops
from labkit.parallel.single import Strategy

#: Short names for Llama's linear layers (the memory estimator accepts the same ones).
TARGET_ALIASES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
                  "up": "up_proj", "down": "down_proj"}
ALL_LINEAR = "all-linear"


def apply_lora(model: nn.Module, group=None, *, cfg) -> nn.Module:
    """Freeze `model` and add LoRA adapters (peft `get_peft_model`); returns the PeftModel.

    `group` is unused (LoRA is a single-device transform; the strategy wraps it in DDP/FSDP after),
    kept so every strategy has the same `apply_<x>(model, group, *, cfg)` signature. `cfg` is a
    TrainConfig or LoraSettings. Works on the meta device (counts without allocating).
    """
    from peft import get_peft_model

    settings = LoraSettings.of(cfg)
    return get_peft_model(model, lora_config(settings, model))


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA knobs of a run (TrainConfig's lora_* fields)."""

    rank: int = 8
    """r: rank of dW = B A. The LoRA paper finds r as small as 1-8 enough on W_q, W_v (Sec. 7.2)."""
    alpha: float = 16.0
    """dW is scaled by alpha / r (Hu et al. 2022 Sec. 4.1). That scale still slows learning as r grows:
    rsLoRA's alpha / sqrt(r) keeps large ranks stable (Kalajdzievski 2023; peft `use_rslora=True`)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (0 keeps single and data-parallel runs loss-for-loss equal)."""
    targets: str = "q,v"
    """Comma-separated linear names ('q,v', 'q,k,v,o', 'q_proj,...') or 'all-linear' (not lm_head)."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ConfigError(f"lora_rank={self.rank!r}; use a positive integer such as 8")
        if not self.alpha > 0:
            raise ConfigError(f"lora_alpha={self.alpha!r}; it must be > 0 (commonly 2 x the rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora_dropout={self.dropout!r}; use a value in [0, 1), e.g. 0.05")
        parse_targets(self.targets)

    @classmethod
    def of(cls, cfg) -> "LoraSettings":
        """Settings from a TrainConfig (or a LoraSettings, returned as is)."""
        if isinstance(cfg, cls):
            return cfg
        return cls(rank=cfg.peft.lora_rank, alpha=float(cfg.peft.lora_alpha), dropout=float(cfg.peft.lora_dropout),
                   targets=cfg.peft.lora_targets)


def frozen_base_dtype(amp: str | None) -> torch.dtype:
    """dtype of a frozen LoRA base: the 16-bit compute dtype under bf16/fp16 AMP, else fp32. Nothing
    trains it, so no fp32 master copy is needed; peft keeps the adapters themselves in fp32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp or "none", torch.float32)


def parse_targets(targets) -> str | tuple[str, ...]:
    """'q,v' -> ('q_proj', 'v_proj'); 'all-linear' (or 'all') -> 'all-linear'."""
    names = targets.split(",") if isinstance(targets, str) else list(targets)
    names = [TARGET_ALIASES.get(n.strip(), n.strip()) for n in names if n.strip()]
    if not names:
        raise ConfigError(f"lora_targets={targets!r} names no layer; use e.g. 'q,v' or 'all-linear'")
    if ALL_LINEAR in names or "all" in names:
        return ALL_LINEAR
    return tuple(dict.fromkeys(names))


def lora_config(settings: LoraSettings, model: nn.Module | None = None):
    """peft `LoraConfig` for `settings`; with `model`, unknown target names are a ConfigError."""
    from peft import LoraConfig

    targets = parse_targets(settings.targets)
    if model is not None and targets != ALL_LINEAR:
        # last name component of every nn.Linear (bitsandbytes' Linear4bit is a subclass)
        valid = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        unknown = sorted(set(targets) - valid)
        if unknown:
            raise ConfigError(f"lora target(s) {unknown} are not linear layers of this model; valid: "
                              f"{', '.join(sorted(valid))} (or all-linear, or short names q,k,v,o,gate,up,down)")
    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=list(targets) if targets != ALL_LINEAR else ALL_LINEAR,
                      bias="none", task_type="CAUSAL_LM")


def trainable_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters as peft counts them (4-bit weights at their logical size)."""
    trainable, total = _unwrap(model).get_nb_trainable_parameters()
    return int(trainable), int(total)


# ---------------------------------------------------------------------------- adapters on disk
def save_adapter(model: nn.Module, path: str | os.PathLike, *, state_dict: dict | None = None) -> int:
    """peft `save_pretrained` (adapter_config.json + safetensors); returns the bytes on disk.
    `state_dict` (full tensors) is for FSDP, where the caller gathers the shards first."""
    _unwrap(model).save_pretrained(Path(path), state_dict=state_dict)
    return adapter_bytes(path)


def adapter_bytes(path: str | os.PathLike) -> int:
    """Bytes on disk of what an adapter ships: its weights and adapter_config.json (not peft's README)."""
    files = [Path(path) / "adapter_config.json", *Path(path).glob("adapter_model.*")]
    if not all(f.is_file() for f in files) or len(files) < 2:
        raise ConfigError(f"no adapter in {path}; save one with save_adapter(model, path)")
    return sum(f.stat().st_size for f in files)


def load_adapter(base: nn.Module, path: str | os.PathLike, *, trainable: bool = False) -> nn.Module:
    """The PeftModel of `base` with the adapter in `path` (peft `PeftModel.from_pretrained`)."""
    from peft import PeftModel

    if not (Path(path) / "adapter_config.json").is_file():
        raise ConfigError(f"{path} holds no adapter_config.json; save the adapter with save_adapter first")
    return PeftModel.from_pretrained(base, str(path), is_trainable=trainable)


def merge(model: nn.Module) -> nn.Module:
    """A plain transformers model with B A folded into W (`merge_and_unload` on a deep copy)."""
    return copy.deepcopy(_unwrap(model)).merge_and_unload()


@torch.no_grad()
def merge_error(model: nn.Module, input_ids: torch.Tensor) -> float:
    """Max |logits(unmerged) - logits(merged)|: W + (alpha/r) B A must equal the two-path forward."""
    model = _unwrap(model)
    was_training = model.training
    try:
        unmerged = model.eval()(input_ids=input_ids).logits.float()
        return float((unmerged - merge(model).eval()(input_ids=input_ids).logits.float()).abs().max())
    finally:
        model.train(was_training)


def sized(model: str, strategies, profile: str, **options) -> dict[str, dict]:
    """Whether each strategy's run of `model` fits `profile`'s GPU, by the estimator, before it runs: the run
    `labkit.train.run(strategy, model, profile=profile, **options)` makes, sized as a rehearsal sizes it
    (`labkit.train.stand_in.size`). Strategy -> {'describe', 'bytes', 'capacity', 'fits', ...}; bytes and
    capacity are None on a CPU profile. 06 asks it whether LoRA or QLoRA of Llama-2-7B fits a 16 GB T4."""
    from labkit.profiles import get_profile
    from labkit.train import stand_in
    from labkit.train.config import from_dict

    node = get_profile(profile)
    found = {}
    for strategy in strategies:
        cfg = from_dict({"strategy": strategy, "model": model, "profile": node.name, **options}).resolve(node)
        found[strategy] = {"describe": stand_in.describe(cfg), **stand_in.size(cfg, node)}
    return found


def format_sized(found: dict[str, dict]) -> str:
    """One line per run of `sized`: the estimator's GB per GPU against what the GPU may hold."""
    from labkit.memory.runs import HEADROOM

    lines = []
    for v in found.values():
        if v["bytes"] is None or v["capacity"] is None:
            lines.append(f"{v['describe']}: not sized ({v['note'] or 'no GPU'})")
            continue
        lines.append(f"{v['describe']}: {v['bytes'] / 1e9:.1f} GB per GPU {'<=' if v['fits'] else '>'} "
                     f"{v['capacity'] / 1e9:.1f} GB ({HEADROOM:.0%} of {v['capacity'] / HEADROOM / 1e9:.3g} GB) -> "
                     f"{'fits' if v['fits'] else 'does not fit'}")
    return "\n".join(lines)


def _is_4bit(p: torch.Tensor) -> bool:
    return type(p).__name__ == "Params4bit" and getattr(p, "quant_state", None) is not None


def _logical_numel(p: torch.Tensor) -> int:  # a packed 4-bit weight holds two elements per byte
    return int(torch.Size(p.quant_state.shape).numel()) if _is_4bit(p) else p.numel()


def _unwrap(model: nn.Module) -> nn.Module:
    for attr in ("_orig_mod", "module"):  # torch.compile, DDP
        model = getattr(model, attr, model)
    return model


# ---------------------------------------------------------------------------- strategies
class LoraStrategy(Strategy):
    """`--strategy lora`: full-precision frozen base + LoRA; DDP or FSDP2 over ranks when nproc > 1."""

    needs_process_group = False  # nproc 1 runs in the notebook's own process
    default_optimizer = "adamw"
    adapter: dict | None = None  # {'adapter_bytes', 'adapter_path'} once saved

    @classmethod
    def check(cls, cfg, world_size: int) -> None:
        super().check(cfg, world_size)
        if cfg.kind != "llm":
            raise ConfigError(f"--strategy {cfg.run.strategy} adapts a transformer's linear layers; {cfg.run.model!r} "
                              "is an image model: use an LLM such as tiny-llama")
        LoraSettings.of(cfg)
        from labkit.optim import OPTIMIZERS
        optimizer = cfg.optim.optimizer or cls.default_optimizer
        if world_size > 1 and cfg.peft.lora_parallel == "fsdp" and OPTIMIZERS[optimizer].library != "torch":
            # FSDP2 hands the optimizer DTensor shards; bitsandbytes' update kernels have no DTensor
            # sharding rule ("Operator bitsandbytes.optimizer_update_32bit ... no sharding strategy").
            raise ConfigError(f"--optimizer {optimizer} (bitsandbytes) cannot step FSDP2's sharded DTensor "
                              "parameters; use --optimizer adamw with --lora-parallel fsdp, or --lora-parallel ddp")

    def build_model(self) -> nn.Module:
        from labkit.zoo.models import build_model
        # The frozen base in the run's 16-bit compute dtype (what the estimator counts: 2 B/param under
        # bf16), not fp32 -- and never in whatever dtype a checkpoint happened to be saved in.
        dtype = frozen_base_dtype(self.cfg.precision.amp)
        base = build_model(self.cfg.run.model, seed=self.cfg.run.seed, dtype=dtype).to(self.ctx.device)
        # A's random init (B = 0) from the run's seed, whatever building the base drew from the RNG
        torch.manual_seed(self.cfg.run.seed)
        # .train(): a checkpoint folder comes back from from_pretrained in eval mode
        return apply_lora(base, self.ctx.group, cfg=self.cfg).train()

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.ctx.world_size == 1:
            return model
        if self.cfg.peft.lora_parallel == "fsdp":
            return _apply_fsdp(model, self.ctx, self.cfg)
        from labkit.runtime import device as devices
        from labkit.parallel.ddp import apply_ddp
        return devices.stand_in_ddp(apply_ddp(model, self.ctx.group, cfg=self.cfg))  # DDP all-reduces only the adapters' grads

    def no_sync(self):
        # Accumulation micro-batches: no gradient communication until the last one (DDP / FSDP2).
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return self.model.no_sync()
        if hasattr(self.model, "set_requires_gradient_sync"):
            from labkit.parallel.fsdp import FSDPStrategy
            return FSDPStrategy.no_sync(self)  # the same switch as --strategy fsdp
        return super().no_sync()

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        from labkit import optim
        name = getattr(getattr(self.cfg, "optim", None), "optimizer", None) or self.default_optimizer
        return optim.build_optimizer(name, [p for p in model.parameters() if p.requires_grad], self.cfg.optim.lr)

    # Checkpoints keep only what trains: the frozen base comes back from its seed / checkpoint.
    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer,
                                            options=StateDictOptions(ignore_frozen_params=True))
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=StateDictOptions(strict=False))

    def flops_per_step(self, global_tokens: int) -> float | None:
        # Frozen weights need forward (2N) and input gradients (2N) but no weight gradients (the 2N
        # the 6N rule charges for them): 4 N_frozen + 6 N_adapters per token, without the embedding.
        model = _unwrap(self.model)
        embed = model.get_input_embeddings().weight
        frozen = sum(_logical_numel(p) for p in model.parameters() if not p.requires_grad and p is not embed)
        adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return finetune_flops(frozen, adapters, global_tokens)

    def record_facts(self) -> dict:
        from labkit.facts import PeftFacts
        trainable, total = trainable_counts(self.model)
        settings = LoraSettings.of(self.cfg)
        return {**super().record_facts(), "peft": PeftFacts(
            lora_rank=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
            lora_targets=sorted(_unwrap(self.model).peft_config["default"].target_modules),
            trainable_fraction=trainable / total, total_params=total,
            lora_parallel=self.cfg.peft.lora_parallel if self.ctx.world_size > 1 else None, **self._adapter_facts())}

    def evaluate(self, batches: list) -> dict | None:
        # The one phase after training that every rank enters (record_facts runs on rank 0 alone), so
        # the adapter is saved here: FSDP gathers its shards collectively.
        result = super().evaluate(batches)
        self.save_adapters()
        return result

    def save_adapters(self) -> None:
        """Write the adapter to OUT/adapters/<run id> on rank 0 (a collective under FSDP)."""
        state = None
        if _is_sharded(self.model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
            state = get_model_state_dict(self.model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
        if self.ctx.is_main:
            path = Path(self.cfg.run.out) / "adapters" / (self.cfg.run.run_id or self.cfg.run.strategy)
            self.adapter = {"adapter_bytes": save_adapter(self.model, path, state_dict=state),
                            "adapter_path": str(path)}

    def _adapter_facts(self) -> dict:
        if self.adapter is None and not _is_sharded(self.model):
            self.save_adapters()  # --eval-batches 0: no evaluation ran; rank 0 holds the whole adapter
        return self.adapter or {"adapter_bytes": None, "adapter_path": None}


def _is_sharded(model: nn.Module) -> bool:
    return any(hasattr(p, "to_local") for p in model.parameters())


def _apply_fsdp(model: nn.Module, ctx, cfg) -> nn.Module:
    """FSDP2 over a LoRA model (labkit.parallel.fsdp): one unit per decoder layer, frozen base weights and
    trainable adapters sharded together (FSDP2 shards per parameter, so mixed requires_grad is fine)."""
    from labkit.parallel import fsdp
    from labkit.parallel.dims import ParallelDims

    mesh = ParallelDims.from_world("fsdp", ctx.world_size).build_mesh(ctx.device)  # 1-D: dp_shard = world
    return fsdp.apply_fsdp(model, mesh, cfg=cfg)


STRATEGY_CLASSES = {"lora": LoraStrategy}
