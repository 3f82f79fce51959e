"""The single-device levers: mixed precision, activation checkpointing, channels_last, torch.compile.

Each is a small function so a strategy hook can apply them in its own order (torchtitan applies
TP -> activation checkpointing -> compile -> FSDP). Introduced in notebook 02_single_gpu.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from labkit.runtime import device as devices

_AMP_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast + (for fp16) a GradScaler: Micikevicius et al. 2018, "Mixed Precision Training".

    bf16 has fp32's exponent range, so gradients do not underflow and need no scaling; fp16 (V100,
    no bf16) multiplies the loss by a dynamic scale before backward and unscales before the step.
    Parameters and optimizer state stay fp32 ("master weights").
    """

    def __init__(self, amp: str, device: torch.device):
        self.amp, self.device = amp, device
        self.dtype = _AMP_DTYPE.get(amp)
        self.scaler = devices.grad_scaler(device) if amp == "fp16" else None

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return devices.autocast(self.device, self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)  # skips the step if any gradient overflowed
            self.scaler.update()
        else:
            optimizer.step()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)


def _block_types() -> tuple[type, ...]:
    from torchvision.models.resnet import BasicBlock, Bottleneck
    return (BasicBlock, Bottleneck)


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each block's activations in backward instead of storing them (Chen et al. 2016,
    "Training Deep Nets with Sublinear Memory Cost"): activation memory ~ one block, ~1/3 more compute.

    LLMs use transformers' own per-decoder-layer switch; ResNets get each residual block's forward
    wrapped in place, so state-dict keys (and checkpoints) stay the same as without it.
    """
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    blocks = [m for m in model.modules() if isinstance(m, _block_types())]
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def apply_channels_last(model: nn.Module) -> nn.Module:
    """NHWC weights: cuDNN's tensor-core convolutions want channels last (inputs are converted by the loop)."""
    return model.to(memory_format=torch.channels_last)


def apply_compile(model: nn.Module) -> nn.Module:
    """torch.compile (TorchInductor): fuses elementwise ops; the first steps pay the compilation."""
    from labkit.runtime import rehearsal
    return torch.compile(model, backend=rehearsal.compile_backend())
