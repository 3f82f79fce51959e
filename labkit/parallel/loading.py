"""Memory-efficient model loading for sharded training: the full model on rank 0 only.

A naive N-rank start builds (or `from_pretrained`-loads) the whole model N times: N x 4.4 GB of host
RAM for TinyLlama-1.1B in fp32 before a single shard exists. The pattern accelerate calls
`cpu_ram_efficient_loading` + `sync_module_states` (and torchtitan/torchtune use with FSDP2):

1. rank 0 builds the real model (random init from a preset, or `from_pretrained(path)`);
   every other rank builds the same architecture on torch's `meta` device, which allocates nothing;
2. a) sharded (FSDP2): every rank shards its copy (`fully_shard` works on meta tensors), the meta
      shards are allocated empty on the device, and rank 0 broadcasts the full state dict while each
      rank keeps only its shard (`set_model_state_dict(..., broadcast_from_rank0=True)`);
   b) replicated (DDP / ZeRO-1/2): meta tensors are allocated empty, then every parameter and buffer
      is broadcast from rank 0 (FSDP1's `sync_module_states=True`).
Non-persistent buffers (Llama's rotary `inv_freq`) are not in any state dict, so they are always
broadcast from rank 0 explicitly, on the compute device also under CPU offload (the broadcast of an
NCCL group moves CUDA tensors only). Introduced in notebook 04_fsdp.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from labkit.errors import ConfigError


def has_meta(model: nn.Module) -> bool:
    """True if any parameter or buffer of `model` is still on the meta device (not allocated)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return any(_local(t).device.type == "meta" for t in tensors)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def build_on_rank0(name: str, rank: int, *, seed: int = 0) -> nn.Module:
    """The real model on rank 0 (in host memory), the same architecture on the meta device elsewhere.

    `name` is an LLM preset or a local checkpoint folder (`labkit.zoo.models.build_llm` semantics: a
    preset is initialised from `seed`, so rank 0 holds exactly what every DDP rank would build).
    """
    from labkit.zoo.models import build_llm, is_llm, llm_config

    if not is_llm(name):
        raise ConfigError(f"memory-efficient loading is for LLMs (presets or checkpoint folders), not {name!r}")
    if rank == 0:
        return build_llm(name, seed=seed)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: no bytes are allocated for the weights
        # fp32 like rank 0's build_llm: transformers 5 would take a checkpoint config's saved dtype (fp16)
        return AutoModelForCausalLM.from_config(llm_config(name), dtype=torch.float32)


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """Allocate (uninitialised) storage on `device` for a meta model; move a real one to `device`."""
    return model.to_empty(device=device) if has_meta(model) else model.to(device)


def broadcast_buffers(model: nn.Module, group, src: int = 0) -> None:
    """Copy every buffer (persistent or not, e.g. rotary `inv_freq`) from rank `src` to all ranks."""
    for buf in model.buffers():
        dist.broadcast(_local(buf), src=src, group=group)


def sync_module_states(model: nn.Module, group, device: torch.device, src: int = 0) -> nn.Module:
    """Replicated start (DDP, ZeRO-1/2): allocate meta tensors, then broadcast params and buffers from `src`.

    Peak host memory on ranks > 0 is one replica (allocated empty, filled by the broadcast), never a
    second copy from a checkpoint read.
    """
    materialize(model, device)
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p.data, src=src, group=group)
    broadcast_buffers(model, group, src)
    return model


def full_state_on_rank0(model: nn.Module, rank: int) -> dict:
    """Rank 0's full state dict (kept alive until the shards are filled); {} on the meta ranks."""
    return {k: v for k, v in model.state_dict().items()} if rank == 0 else {}


def place_buffers(model: nn.Module, device: torch.device) -> nn.Module:
    """Move every buffer (persistent or not) to `device`, leaving the parameters where they are."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
    return model


def load_sharded_from_rank0(model: nn.Module, full_state: dict, *, group, device: torch.device,
                            buffers_on: torch.device | None = None) -> nn.Module:
    """Sharded start (FSDP2): fill an already `fully_shard`-ed model from rank 0's full state dict.

    Every rank calls this after `fully_shard`; ranks > 0 pass `full_state={}`. Each tensor is
    broadcast once from rank 0 and each rank copies out only its own shard (DTensor placement), so
    no rank but 0 ever holds a full tensor of the model for longer than one broadcast.

    `device`: where the parameter shards live (the host under CPU offload); `buffers_on` (default
    `device`): where the buffers live -- the compute device, as `fully_shard` put rank 0's. Under
    CPU offload on GPUs the two differ: `to_empty(cpu)` would leave the meta ranks' buffers (rotary
    `inv_freq`) on the host, the forward would mix devices, and their broadcast over an NCCL group
    (which moves CUDA tensors only) would fail. Unverified on hardware here: tested on CPU ranks.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if has_meta(model):
        model.to_empty(device=device)
    place_buffers(model, buffers_on or device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state, options=options)
    broadcast_buffers(model, group)
    return model
