"""Stacking the memory levers: FSDP2 over a 4-bit NF4 base with LoRA adapters (`--strategy fsdp-qlora`).

The recipe that fine-tunes a 70B model on two 24 GB GPUs (Answer.AI, "You can now train a 70b language
model at home", 2024): QLoRA (Dettmers et al. 2023) stores the frozen base in NF4 -- 70 B params x
~0.52 B = ~36 GB -- and FSDP (Zhao et al. 2023) shards those bytes over the GPUs, so each of two
GPUs keeps ~18 GB of packed weights plus one gathered block at a time, the LoRA adapters (Hu et al.
2022), their optimizer state (8-bit paged AdamW, Dettmers et al. 2022) and activations (with
checkpointing). `fsdp-qlora-offload` adds FSDP2's CPUOffloadPolicy: shards live in host RAM and are
copied to the GPU unit by unit (ZeRO-Offload, Ren et al. 2021).

Why it works with FSDP2: FSDP2 shards every parameter on its own (a DTensor per parameter, dim 0),
all-gathers parameters of mixed dtypes in one unit, and never casts integer tensors under a
MixedPrecisionPolicy. So the packed uint8 NF4 weights (shape (n/2, 1)) are sharded and gathered
byte-exactly, next to bf16 norms and fp32 adapters. bitsandbytes keeps each layer's QuantState
(absmax, code) on the module and re-attaches it to the gathered weight in `Linear4bit.forward`
(`fix_4bit_weight_quant_state_from_module`). FSDP1 flattened a unit into ONE FlatParameter of ONE dtype,
which is why the FSDP1-era recipe stored NF4 in bf16 (`bnb_4bit_quant_storage`); here a float storage
would be wrong: a bf16 MixedPrecisionPolicy would cast it.

What runs on CPU (smoke, 2 gloo ranks): all of it -- NF4 quantization while loading (bitsandbytes' CPU
backend), FSDP2 sharding and gathering of the packed weights over gloo, LoRA training with bf16
autocast, 8-bit AdamW. Offload is bookkeeping on CPU (host memory IS the device; pinning needs the
NVIDIA driver, so it is off). The QuantState constants are replicated, not sharded (~1/32 of the
packed bytes with double quantization). Introduced in notebook 08_profiling_and_stacking.
"""
from __future__ import annotations

import torch
from torch import nn

from labkit.runtime import device as devices
from labkit.errors import ConfigError
from labkit.parallel import fsdp
from labkit.parallel.peft import LoraSettings, LoraStrategy, trainable_counts
from labkit.parallel.qlora import QLoraStrategy, _quant_state_tensors, apply_qlora, load_4bit
from labkit.train.metrics import ResidentBytes, resident_bytes, tensor_bytes

VARIANTS = {"fsdp-qlora": fsdp.FsdpPlan(), "fsdp-qlora-offload": fsdp.FsdpPlan(offload=True)}


def four_bit_modules(model: nn.Module) -> list[nn.Module]:
    """bitsandbytes Linear4bit layers (their QuantState lives on the module once the weight is sharded);
    not peft's wrapper of the same class name."""
    from bitsandbytes.nn import Linear4bit
    return [m for m in model.modules() if isinstance(m, Linear4bit)]


def check_storage(model: nn.Module, param_dtype: torch.dtype | None) -> None:
    """ConfigError if a packed 4-bit weight is stored in a float dtype FSDP's mixed precision would cast."""
    for m in four_bit_modules(model):
        dtype = m.weight.dtype
        if dtype.is_floating_point and param_dtype is not None and dtype != param_dtype:
            raise ConfigError(f"4-bit weights are stored as {dtype} but FSDP gathers parameters in {param_dtype}: "
                              "the cast would corrupt the packed NF4 bytes; load with bnb_4bit_quant_storage="
                              "torch.uint8 (labkit.parallel.qlora.load_4bit does)")


def apply_fsdp_qlora(model: nn.Module, mesh, *, cfg, offload: bool = False) -> nn.Module:
    """`fully_shard` a QLoRA model (from `qlora.apply_qlora`): one unit per decoder layer, then the root.

    Adapters and frozen NF4 weights of a layer share its unit. `cfg.precision.amp` picks the MixedPrecisionPolicy
    (bf16: gathered adapters / norms in bf16, gradients reduced in fp32).
    """
    plan = VARIANTS["fsdp-qlora-offload" if offload else "fsdp-qlora"]
    check_storage(model, fsdp.mp_policy_for(getattr(getattr(cfg, "precision", None), "amp", "none")).param_dtype)
    return fsdp.apply_fsdp(model, mesh, cfg=cfg, plan=plan)


def quant_state_bytes(model: nn.Module) -> int:
    """Bytes of the NF4 layers' absmax / code / offset constants (replicated on every rank)."""
    tensors = [t for m in four_bit_modules(model) if m.quant_state is not None
               for t in _quant_state_tensors(m.quant_state)]
    return sum(tensor_bytes(tensors, torch.device("cpu"))) if tensors else 0


def packed_bytes(model: nn.Module) -> int:
    """Bytes of this rank's packed 4-bit weights (its shard once sharded)."""
    weights = [m.weight for m in four_bit_modules(model)]
    return sum(tensor_bytes(weights, weights[0].device if weights else torch.device("cpu")))


def logical_counts(model: nn.Module) -> dict[str, int]:
    """Parameters the unsharded QLoRA model represents: frozen (4-bit counted at full size), adapters."""
    trainable, total = trainable_counts(model)
    embed = model.get_input_embeddings().weight.numel()
    return {"trainable": trainable, "total": total, "frozen_no_embed": total - trainable - embed}


class FsdpQLoraStrategy(QLoraStrategy):
    """`--strategy fsdp-qlora[-offload]`: NF4 base + LoRA (peft), sharded with FSDP2 over all ranks."""

    needs_process_group = True  # FSDP2 needs a process group even on one rank
    # bitsandbytes' optimizers call their own kernels (bitsandbytes.optimizer_update_32bit / _8bit_blockwise)
    # on plain tensors: they have no DTensor sharding rule, so they cannot step FSDP2's sharded adapters.
    default_optimizer = "adamw"

    def __init__(self, name, ctx, cfg, task):
        super().__init__(name, ctx, cfg, task)
        self.plan, self.mesh, self.counts = VARIANTS[name], None, {}

    @classmethod
    def check(cls, cfg, world_size: int) -> None:
        LoraStrategy.check.__func__(cls, cfg, world_size)  # not QLoraStrategy's: it refuses FSDP
        if cfg.peft.lora_parallel != "ddp":
            raise ConfigError(f"--strategy {cfg.run.strategy} always shards with FSDP2; drop --lora-parallel")
        from labkit.optim import OPTIMIZERS
        if cfg.optim.optimizer and OPTIMIZERS[cfg.optim.optimizer].library == "bitsandbytes":
            raise ConfigError(f"--optimizer {cfg.optim.optimizer} cannot step FSDP2's sharded parameters: bitsandbytes' "
                              "update kernels take plain tensors and have no DTensor sharding rule "
                              "(NotImplementedError: bitsandbytes.optimizer_update_32bit ...); use --optimizer "
                              "adamw (the adapters' states are small), or torchao.optim.AdamW8bit, which supports "
                              "DTensor, where torchao is installed")

    def build_model(self) -> nn.Module:
        # Quantize on the host: a 70B base is ~36 GB in NF4, more than one 24 GB GPU holds before
        # sharding; fully_shard then moves each unit's shard to the GPU (QuantState moves in place).
        compute = torch.float16 if self.amp == "fp16" else torch.bfloat16
        model = load_4bit(self.base_checkpoint(), device="cpu", compute_dtype=compute)
        return apply_qlora(model, None, cfg=self.cfg, checkpointing=self.cfg.memory.checkpointing).train()

    def base_checkpoint(self):
        # Rank 0 may save the seeded preset first (build_llm reseeds the RNG). FSDP2 keeps each rank's own
        # slice of the freshly initialised adapters (nothing is broadcast), so every rank's RNG must
        # stay identical up to the LoRA init: save with the RNG state forked.
        with torch.random.fork_rng(devices=[]):
            return super().base_checkpoint()

    def wrap(self, model: nn.Module) -> nn.Module:
        self.counts = logical_counts(model)
        self.counts["packed_4bit_full_bytes"] = packed_bytes(model)
        self.mesh = self.dims.build_mesh(self.ctx.device, fsdp.MESH_DIMS[self.plan.mesh][1])
        return apply_fsdp_qlora(model, self.mesh, cfg=self.cfg.replace(amp=self.amp),
                                offload=self.plan.offload)

    def resident_bytes(self) -> ResidentBytes:
        # Parameters by local shard (DTensor), plus the replicated QuantState constants.
        base = resident_bytes(self.model, self.optimizer, self.ctx.device)
        base = base._replace(param=base.param + quant_state_bytes(self.model))
        if self.plan.offload and not devices.is_gpu(self.ctx.device):  # host IS the device: report the policy
            base = base._replace(cpu_offload=base.param + base.grad + base.optimizer)
        return base

    def flops_per_step(self, global_tokens: int) -> float | None:
        # 4 N_frozen (forward + input gradients) + 6 N_adapters per token (see LoraStrategy).
        return (4.0 * self.counts["frozen_no_embed"] + 6.0 * self.counts["trainable"]) * global_tokens

    def record_facts(self) -> dict:
        from labkit.facts import MemoryFacts, PeftFacts, ShardingFacts
        from labkit.optim import facts as optim_facts
        settings = LoraSettings.of(self.cfg)
        shape, names = self.dims.mesh_shape(fsdp.MESH_DIMS[self.plan.mesh][1])
        peft = PeftFacts(lora_rank=settings.rank, lora_alpha=settings.alpha, lora_targets=settings.targets,
                         trainable_fraction=self.counts["trainable"] / self.counts["total"],
                         total_params=self.counts["total"], quant_type="nf4", double_quant=True,
                         compute_dtype="bfloat16" if self.amp == "bf16" else "float16", quant_storage="uint8",
                         packed_4bit_full_bytes=self.counts["packed_4bit_full_bytes"],
                         packed_4bit_rank_bytes=packed_bytes(self.model),
                         quant_state_bytes_replicated=quant_state_bytes(self.model), **self._adapter_facts())
        return {"optim": optim_facts(self.optimizer), "peft": peft,
                "sharding": ShardingFacts(mesh_shape=list(shape), mesh_dims=list(names)),
                "memory": MemoryFacts(offload=self.plan.offload,
                                      offload_physical=self.plan.offload and devices.is_gpu(self.ctx.device))}


STRATEGY_CLASSES = {name: FsdpQLoraStrategy for name in VARIANTS}
