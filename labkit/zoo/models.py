"""Build the course's models from presets or local checkpoints. Models know nothing about parallelism.

- LLMs: transformers `LlamaForCausalLM` built from a preset config, or loaded with
  `from_pretrained(path)` from a local folder or a Hugging Face id in the HF cache (`labkit.zoo.hub`;
  `labkit fetch ID` fills the cache). A checkpoint loads in an explicit dtype: transformers 5 keeps
  the saved one (often fp16) otherwise, and a full fine-tune needs fp32 weights.
- Vision: torchvision ResNets (`resnet50` is torchvision's own constructor).
In a rehearsal (`labkit.runtime.rehearsal`) every model is its stand-in: the same family and layer structure
with shrunk widths, built from the real config (a checkpoint's config is read from its folder or the
HF cache as on the node; its weights are not loaded).
Introduced in notebook 02_single_gpu (vision) and 04_fsdp (LLM).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from labkit.zoo import hub, presets
from labkit.errors import ConfigError


def is_llm(name: str) -> bool:
    """True for an LLM preset, a local checkpoint folder (one with a config.json) or a HF id 'ORG/NAME'."""
    return name in presets.LLM_PRESETS or _is_checkpoint(name) or hub.is_hub_id(name)


def _is_checkpoint(name: str) -> bool:
    return (Path(name) / "config.json").is_file()


def checkpoint_dir(name: str, *, weights: bool = True) -> Path | None:
    """The folder `from_pretrained` reads: a local checkpoint, or a HF id's cached snapshot (ConfigError
    naming `labkit fetch ID` when it is not cached); None for a preset."""
    if _is_checkpoint(name):
        return Path(name)
    if hub.is_hub_id(name):
        return hub.resolve(name, weights=weights)
    return None


def llm_config(name: str):
    """The `LlamaConfig` of a preset, or the config of a local checkpoint folder."""
    from transformers import AutoConfig, LlamaConfig

    from labkit.runtime import rehearsal

    if name in presets.LLM_PRESETS:
        preset = presets.LLM_PRESETS[name]
        if "num_local_experts" in preset:  # mixture of experts (tiny-moe): Mixtral's layout
            from transformers import MixtralConfig
            config = MixtralConfig(**preset)
        else:
            config = LlamaConfig(**preset)
        return rehearsal.llm_config(config, keep_vocab=False) if rehearsal.active() else config
    folder = checkpoint_dir(name, weights=False)
    if folder is not None:
        config = AutoConfig.from_pretrained(folder)
        if rehearsal.active():  # a tokenizer beside the weights makes the data's ids: keep its vocabulary
            return rehearsal.llm_config(config, keep_vocab=(folder / "tokenizer_config.json").is_file())
        return config
    raise ConfigError(f"unknown LLM {name!r}: use one of {', '.join(presets.LLM_PRESETS)}, a local folder "
                      "holding config.json (from save_pretrained) or a Hugging Face id ORG/NAME")


def build_llm(name: str, *, seed: int = 0, dtype: torch.dtype | None = None, **load_kwargs) -> nn.Module:
    """A causal LM: random init from a preset (seeded), or `from_pretrained` for a checkpoint / HF id.

    A checkpoint loads in `dtype`, default fp32 (trained weights need an fp32 copy for the optimizer;
    a frozen LoRA base passes its 16-bit compute dtype), never silently in the dtype it was saved in.
    """
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from labkit.runtime import rehearsal

    folder = checkpoint_dir(name, weights=not rehearsal.active())
    if folder is not None and not rehearsal.active():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32, **load_kwargs)
    config = llm_config(name)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config) if config.model_type == "llama" else AutoModelForCausalLM.from_config(config)
    return model.to(dtype) if dtype is not None else model


def build_vision(name: str, *, seed: int = 0) -> nn.Module:
    """A torchvision ResNet for a vision preset, seeded."""
    from torchvision.models import resnet50
    from torchvision.models.resnet import Bottleneck, ResNet

    if name not in presets.VISION_PRESETS:
        raise ConfigError(f"unknown vision model {name!r}: use one of {', '.join(presets.VISION_PRESETS)}")
    torch.manual_seed(seed)
    spec = presets.VISION_PRESETS[name]
    from labkit.runtime import rehearsal
    stand_in = rehearsal.vision(name, spec) if rehearsal.active() else None
    if stand_in is not None:
        return stand_in
    if name == "resnet50":
        return resnet50(weights=None)
    return ResNet(Bottleneck, list(spec["layers"]), num_classes=spec["num_classes"])


def build_model(name: str, *, seed: int = 0, dtype: torch.dtype | None = None) -> nn.Module:
    """Any course model by name (preset or local LLM checkpoint)."""
    if is_llm(name):
        return build_llm(name, seed=seed, dtype=dtype)
    if name in presets.VISION_PRESETS:
        return build_vision(name, seed=seed)
    valid = list(presets.LLM_PRESETS) + list(presets.VISION_PRESETS)
    raise ConfigError(f"unknown model {name!r}: use one of {', '.join(valid)}, a local LLM checkpoint folder "
                      "or a Hugging Face id ORG/NAME")


def save_llm(name: str, path: str | os.PathLike, *, seed: int = 0) -> Path:
    """Build preset `name` and `save_pretrained` it to `path` (how smoke runs get a 'checkpoint')."""
    path = Path(path)
    build_llm(name, seed=seed).save_pretrained(path)
    return path


def count_params(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameters (each shared tensor once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total
