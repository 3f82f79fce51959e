"""QLoRA (`--strategy qlora`): LoRA adapters on a frozen 4-bit NormalFloat base (`labkit.parallel.peft`
holds LoRA itself).

Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs": store the frozen base in 4-bit
NormalFloat (NF4, Sec. 3), quantize the per-block absmax constants again (double quantization, 0.127
bits/param), compute in bf16, and page the optimizer state (paged 8-bit AdamW) so memory spikes spill
to host RAM. 7B weights: ~13.5 GB bf16 -> ~3.9 GB. The base is loaded the way a GPU user loads a real
checkpoint: `from_pretrained(path, quantization_config=bnb_config())` (`load_4bit`), then
`apply_qlora`. Introduced in notebook 06_peft.
"""
from __future__ import annotations

import dataclasses

import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from labkit.errors import ConfigError
from labkit.parallel.peft import LoraStrategy, _is_4bit, _logical_numel, _unwrap, apply_lora
from labkit.train.metrics import ResidentBytes


def bnb_config(compute_dtype: torch.dtype = torch.bfloat16):
    """The QLoRA recipe's BitsAndBytesConfig: NF4 storage, double quantization, 16-bit compute."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def load_4bit(path: str | os.PathLike, *, device: torch.device | str = "cpu",
              compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """`from_pretrained(path)` with every block linear quantized to NF4 while loading.

    The same call a GPU user makes on a real checkpoint; smoke runs save a preset first
    (`labkit.zoo.models.save_llm`). bitsandbytes quantizes each weight flattened in blocks of 64, so
    only the element count must divide by 64 (tiny-llama's 64 x 32 k_proj does).
    """
    from transformers import AutoModelForCausalLM

    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"{path} is not a saved model (no config.json); create one with "
                          "labkit.zoo.models.save_llm('tiny-llama', path) or pass a local checkpoint folder")
    from labkit.runtime import device as devices

    device = torch.device(device)
    # the GPU's index on the node; a rehearsal loads on the CPU standing in for it
    device_map = {"": device.index or 0} if device.type == "cuda" else "cpu"
    if devices.standing_in() and devices.is_gpu(device):
        devices.record("from_pretrained_4bit", device_map={"": devices.logical(device)})
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb_config(compute_dtype),
                                                 device_map=device_map, dtype=compute_dtype)
    for module in model.modules():
        # On CPU, bitsandbytes repacks a 4-bit weight for its AVX512-bf16 inference kernel the first time
        # it runs in eval mode without grad, un-nesting the double-quantized absmax into bf16. Keep the
        # training layout, so evaluation and byte counts describe what trains.
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def apply_qlora(model: nn.Module, group=None, *, cfg, checkpointing: bool = False) -> nn.Module:
    """LoRA on a 4-bit model from `load_4bit`: peft `prepare_model_for_kbit_training` + `apply_lora`.

    prepare_model_for_kbit_training freezes everything and upcasts every 16-bit parameter that is not
    4-bit to fp32 -- the norms, and also the embedding and LM head (peft/utils/other.py). Like the QLoRA
    reference script (artidoro/qlora, `get_accelerate_model`) we put the frozen embedding and LM head
    back into the compute dtype -- fp32 would add 2 B per parameter, +0.52 GB on Llama-2-7B, +2.1 GB on
    Llama-3-8B (`labkit.memory.conventions.kbit_upcast_bytes`) -- and keep only the norms in fp32, which
    is what `labkit.memory.estimate` assumes.
    """
    from peft import prepare_model_for_kbit_training

    if not getattr(model, "is_loaded_in_4bit", False):
        raise ConfigError("apply_qlora needs a 4-bit model: load it with labkit.parallel.qlora.load_4bit(path)")
    compute = model.config.quantization_config.bnb_4bit_compute_dtype
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is not None:
            module.to(compute)
    return apply_lora(model, group, cfg=cfg)


def _quant_state_tensors(state) -> list[torch.Tensor]:
    """absmax / code / offset of a QuantState and of its nested (double-quantization) state."""
    found = [getattr(state, k, None) for k in ("absmax", "code", "offset")]
    nested = getattr(state, "state2", None)
    return [t for t in found if isinstance(t, torch.Tensor)] + (_quant_state_tensors(nested) if nested else [])


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Resident weight bytes, honestly: packed 4-bit storage, its quantization constants, the rest.

    Every storage is counted once. `bf16_equivalent` is what the same weights take in bf16 (adapters
    excluded: the base a full bf16 load would hold).
    """
    seen: set[int] = set()
    out = {"packed_4bit": 0, "quant_state": 0, "other": 0, "bf16_equivalent": 0}

    def add(key: str, t: torch.Tensor) -> None:
        t = t.to_local() if hasattr(t, "to_local") else t
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen and t.device.type != "meta":
            seen.add(ptr)
            out[key] += t.untyped_storage().nbytes()

    for name, p in _unwrap(model).named_parameters():
        if _is_4bit(p):
            add("packed_4bit", p)
            for t in _quant_state_tensors(p.quant_state):
                add("quant_state", t)
        else:
            add("other", p)
        if "lora_" not in name:
            out["bf16_equivalent"] += 2 * _logical_numel(p)
    out["total"] = out["packed_4bit"] + out["quant_state"] + out["other"]
    return out


# ---------------------------------------------------------------------------- strategy
class QLoraStrategy(LoraStrategy):
    """`--strategy qlora`: NF4 base loaded through from_pretrained(path), LoRA, paged 8-bit AdamW."""

    default_optimizer = "paged-adamw-8bit"

    def __init__(self, name, ctx, cfg, task):
        super().__init__(name, ctx, cfg, task)
        # QLoRA computes in 16 bit (bf16; fp16 on V100): the embedding and head are stored in it too,
        # so an fp32 profile ('smoke') still runs its forward under bf16 autocast.
        from labkit.train import levers
        self.amp = cfg.precision.amp if cfg.precision.amp in ("bf16", "fp16") else "bf16"
        self.precision = levers.Precision(self.amp, ctx.device)

    def build_model(self) -> nn.Module:
        compute = torch.float16 if self.amp == "fp16" else torch.bfloat16
        model = load_4bit(self.base_checkpoint(), device=self.ctx.device, compute_dtype=compute)
        torch.manual_seed(self.cfg.run.seed)  # same adapter init whether or not the base was just saved
        model = apply_qlora(model, self.ctx.group, cfg=self.cfg, checkpointing=self.cfg.memory.checkpointing)
        return model.train()  # from_pretrained returns eval mode

    def base_checkpoint(self) -> Path:
        """The folder `from_pretrained` loads: the checkpoint itself, or (smoke) the seeded preset saved
        once to OUT/base/<model>-seed<seed>, like a downloaded checkpoint. Rank 0 writes it."""
        from labkit.runtime import rehearsal
        from labkit.zoo.models import checkpoint_dir
        folder = checkpoint_dir(self.cfg.run.model)  # a local checkpoint or a cached HF id
        if folder is not None and not rehearsal.active():  # a rehearsal saves its stand-in instead
            return folder
        path = Path(self.cfg.run.out) / "base" / f"{self.cfg.run.model.replace('/', '--')}-seed{self.cfg.run.seed}"
        if self.ctx.is_main and not (path / "config.json").is_file():
            from labkit.zoo.models import save_llm
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=path.parent))
            save_llm(self.cfg.run.model, tmp, seed=self.cfg.run.seed)
            os.replace(tmp, path)  # atomic: a crashed save never looks complete
        if self.ctx.group is not None:
            import torch.distributed as dist
            dist.barrier(group=self.ctx.group)
        return path

    def resident_bytes(self) -> ResidentBytes:
        # The default counts parameters only; a 4-bit weight's absmax / code live in its QuantState.
        base = super().resident_bytes()
        wb = weight_bytes(self.model)
        return base._replace(param=base.param + wb["quant_state"])

    def record_facts(self) -> dict:
        facts = super().record_facts()
        wb = weight_bytes(self.model)
        return {**facts, "peft": dataclasses.replace(
            facts["peft"], quant_type="nf4", double_quant=True, quant_blocksize=64,
            compute_dtype="bfloat16" if self.amp == "bf16" else "float16",
            weight_bytes=wb, weight_ratio_vs_bf16=wb["total"] / wb["bf16_equivalent"])}


STRATEGY_CLASSES = {"qlora": QLoraStrategy}
