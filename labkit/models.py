"""Build the course's models from presets or local checkpoints. Models know nothing about parallelism.

- LLMs: transformers `LlamaForCausalLM` built from a preset config, or loaded with
  `from_pretrained(path)` from a local folder (the same call a GPU user makes on a real checkpoint).
- Vision: torchvision ResNets (`resnet50` is torchvision's own constructor).
Introduced in notebook 02_single_gpu (vision) and 04_fsdp (LLM).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from labkit import presets
from labkit.errors import ConfigError


def is_llm(name: str) -> bool:
    """True for an LLM preset or a local checkpoint folder (one with a config.json)."""
    return name in presets.LLM_PRESETS or _is_checkpoint(name)


def _is_checkpoint(name: str) -> bool:
    return (Path(name) / "config.json").is_file()


def llm_config(name: str):
    """The `LlamaConfig` of a preset, or the config of a local checkpoint folder."""
    from transformers import AutoConfig, LlamaConfig

    if name in presets.LLM_PRESETS:
        preset = presets.LLM_PRESETS[name]
        if "num_local_experts" in preset:  # mixture of experts (tiny-moe): Mixtral's layout
            from transformers import MixtralConfig
            return MixtralConfig(**preset)
        return LlamaConfig(**preset)
    if _is_checkpoint(name):
        return AutoConfig.from_pretrained(name)
    raise ConfigError(f"unknown LLM {name!r}: use one of {', '.join(presets.LLM_PRESETS)} "
                      "or a local folder holding config.json (from save_pretrained)")


def build_llm(name: str, *, seed: int = 0, dtype: torch.dtype | None = None, **load_kwargs) -> nn.Module:
    """A causal LM: random init from a preset (seeded), or `from_pretrained` for a local checkpoint."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if _is_checkpoint(name):
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **load_kwargs)
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
    if name == "resnet50":
        return resnet50(weights=None)
    spec = presets.VISION_PRESETS[name]
    return ResNet(Bottleneck, list(spec["layers"]), num_classes=spec["num_classes"])


def build_model(name: str, *, seed: int = 0, dtype: torch.dtype | None = None) -> nn.Module:
    """Any course model by name (preset or local LLM checkpoint)."""
    if is_llm(name):
        return build_llm(name, seed=seed, dtype=dtype)
    if name in presets.VISION_PRESETS:
        return build_vision(name, seed=seed)
    valid = list(presets.LLM_PRESETS) + list(presets.VISION_PRESETS)
    raise ConfigError(f"unknown model {name!r}: use one of {', '.join(valid)} or a local LLM checkpoint folder")


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
