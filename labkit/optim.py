"""Optimizer factory: `--optimizer adamw | adamw-8bit | paged-adamw-8bit | ...` for every strategy.

Adam keeps two fp32 moments per parameter, 8 bytes/param: for Llama-2-7B that is 54 GB, more than the
fp16 weights and gradients together. Dettmers et al. 2022 ("8-bit Optimizers via Block-wise
Quantization", ICLR 2022) store both moments in 8 bits, quantized in blocks of 256 with one fp32 absmax
per block and a non-linear ("dynamic") code, so state drops to ~2 bytes/param with no loss in quality.
Paged optimizers (QLoRA paper, Dettmers et al. 2023, Sec. 3) put that state in CUDA unified memory so
the driver evicts it to host RAM when a long sequence spikes activation memory instead of failing with
OOM. On CPU, bitsandbytes falls back to ordinary (non-paged) state with a warning: `is_paged()` reports
what a run really had.

bitsandbytes keeps tensors smaller than `min_8bit_size` elements (default 4096) in 32-bit state: their
per-tensor quantization maps would cost more than they save. LoRA matrices of small models fall under
it. Importing this module does not import torch (TrainConfig checks names with it).
Introduced in notebook 06_peft.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Iterable

from labkit.errors import ConfigError, choices_error

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class OptimizerSpec:
    """What an optimizer name means: which class and how many bytes of state it keeps per parameter."""

    library: str
    """'torch' or 'bitsandbytes'."""
    cls_name: str
    """Class name in `torch.optim` or `bitsandbytes.optim`."""
    state_bytes_per_param: float
    """Optimizer state per parameter at steady state (ignoring per-block absmax and tiny tensors)."""
    paged: bool = False
    """State in CUDA unified memory (evictable to host RAM); CPU runs fall back to non-paged."""
    description: str = ""


#: name -> spec. State sizes: Adam two moments (2 x 4 B fp32, or 2 x 1 B in 8-bit); SGD one momentum.
OPTIMIZERS = MappingProxyType({
    "adamw": OptimizerSpec("torch", "AdamW", 8.0, description="torch AdamW, fp32 moments"),
    "adamw-8bit": OptimizerSpec("bitsandbytes", "AdamW8bit", 2.0,
                                description="block-wise 8-bit moments (Dettmers et al. 2022)"),
    "paged-adamw": OptimizerSpec("bitsandbytes", "PagedAdamW", 8.0, paged=True,
                                 description="fp32 moments in paged (unified) memory"),
    "paged-adamw-8bit": OptimizerSpec("bitsandbytes", "PagedAdamW8bit", 2.0, paged=True,
                                      description="8-bit moments in paged memory (the QLoRA recipe)"),
    "sgd": OptimizerSpec("torch", "SGD", 4.0, description="SGD with momentum 0.9, one fp32 buffer"),
})

#: The harness's default AdamW (labkit.parallel.single) uses no weight decay; every optimizer here
#: does the same by default so `--optimizer` changes only the state format, and runs compare.
DEFAULT_WEIGHT_DECAY = 0.0


def check_name(name: str) -> OptimizerSpec:
    """The spec of optimizer `name`; ConfigError listing the valid names otherwise."""
    if name not in OPTIMIZERS:
        raise choices_error("optimizer", name, OPTIMIZERS)
    return OPTIMIZERS[name]


def _class(spec: OptimizerSpec):
    if spec.library == "torch":
        import torch
        return getattr(torch.optim, spec.cls_name)
    try:
        import bitsandbytes.optim as bnb_optim
    except ImportError as exc:  # pragma: no cover - the course environment ships bitsandbytes
        raise ConfigError(f"optimizer {spec.cls_name} needs bitsandbytes: `pip install bitsandbytes`, "
                          "or use --optimizer adamw") from exc
    return getattr(bnb_optim, spec.cls_name)


def build_optimizer(name: str, params: Iterable, lr: float, *, weight_decay: float = DEFAULT_WEIGHT_DECAY,
                    min_8bit_size: int = 4096) -> torch.optim.Optimizer:
    """Optimizer `name` over `params` (an iterable of tensors or of param-group dicts).

    Only trainable parameters should be passed (LoRA: the adapters); an empty list is a ConfigError
    because a frozen model cannot train. `min_8bit_size` is bitsandbytes' threshold below which a
    tensor keeps 32-bit state.
    """
    spec = check_name(name)
    params = list(params)
    if not params:
        raise ConfigError(f"optimizer {name!r} got no trainable parameters; unfreeze some (e.g. apply LoRA) "
                          "before building the optimizer")
    if not lr > 0:
        raise ConfigError(f"lr={lr!r}; it must be > 0")
    cls = _class(spec)
    if spec.cls_name == "SGD":
        return cls(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    kwargs = dict(lr=lr, weight_decay=weight_decay)
    if spec.library == "bitsandbytes" and spec.state_bytes_per_param < 8:
        kwargs["min_8bit_size"] = min_8bit_size
    with warnings.catch_warnings():
        # bitsandbytes warns on CPU that paging falls back to plain memory; is_paged() reports it.
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported")
        return cls(params, **kwargs)


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """The factory name of an optimizer instance ('adamw-8bit', ...), or its class name if foreign."""
    cls_name = type(optimizer).__name__
    for name, spec in OPTIMIZERS.items():
        if spec.cls_name == cls_name:
            return name
    return cls_name


def is_paged(optimizer: torch.optim.Optimizer) -> bool:
    """True when the optimizer's state really lives in paged (CUDA unified) memory."""
    spec = OPTIMIZERS.get(optimizer_name(optimizer))
    if spec is None or not spec.paged:
        return False
    devices = {p.device.type for g in optimizer.param_groups for p in g["params"]}
    return devices == {"cuda"}


def state_bits(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameters (numel) by bits of optimizer state actually allocated: {'8': n, '32': m}.

    Tells how much of the model the 8-bit path covered (tensors under min_8bit_size stay 32-bit).
    Parameters without state yet (before the first step) are not counted.
    """
    counts: dict[str, int] = {}
    for param, state in optimizer.state.items():
        moments = [v for k, v in state.items() if k in ("state1", "exp_avg", "momentum_buffer")]
        if not moments:
            continue
        bits = str(moments[0].element_size() * 8)
        counts[bits] = counts.get(bits, 0) + param.numel()
    return counts


def facts(optimizer: torch.optim.Optimizer):
    """A run record's `optim` facts: name, paged for real, parameters per state width."""
    from labkit.facts import OptimizerFacts
    return OptimizerFacts(name=optimizer_name(optimizer), paged=is_paged(optimizer),
                          state_bits=state_bits(optimizer))
