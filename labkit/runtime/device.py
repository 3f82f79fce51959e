"""Which device a rank computes on, and the CUDA-only APIs around it: set_device, NCCL groups, meshes,
pinned memory, TF32 and cuDNN switches, autocast, the GPU's size, name and RNG state; with its sibling
`labkit.runtime.allocator` (synchronize, timing events, the caching allocator, snapshots, NVTX) the one
place labkit calls CUDA. Everything else asks this module (`is_gpu(device)`) instead of branching on
`torch.cuda.is_available()` or a device's type.

Every function takes the device a run computes on (`ctx.device`). On a GPU node that is `cuda:r`
and each function does the CUDA thing. In a **rehearsal** (`LABKIT_REHEARSE=1`, issue #25: a GPU
profile's notebook executed on a machine without GPUs) the rank's device is the CPU standing in for
`cuda:r`: `is_gpu` answers True, so the GPU branch of every caller runs, and each function here
*records* what it would have done on the node (`calls()`, and one JSON line per call in the file
`LABKIT_REHEARSE_LOG`) and acts on the CPU instead. Tests assert on the record: "rank r uses
cuda:r", "the mesh and the model agree on the device type", "the group backend is nccl".

Unverified on hardware here (no GPU in CI): the CUDA side of each function is the documented torch
call, exercised on CPU only through the rehearsal's record. Introduced in notebook 02_single_gpu.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
from dataclasses import dataclass
from typing import Any

import torch

from labkit.errors import RehearsalError
from labkit.runtime.rehearsal import active as rehearsing
from labkit.runtime.rehearsal import calls, clear_calls, record  # noqa: F401 - the record of what the node would do


class RehearsalOOM(RehearsalError, torch.OutOfMemoryError):
    """CUDA out of memory as the node would raise it: a run's estimate at its real size does not fit."""


@dataclass
class _StandIn:
    """What this rehearsing process stands in for: the node's GPU of one profile."""

    profile: str = ""
    gpu_name: str = ""
    memory_bytes: int = 0
    gpus: int = 0
    local_rank: int = 0


_STAND_IN: _StandIn | None = None


def standing_in() -> bool:
    """True when this process rehearses a GPU profile's rank (its CPU stands in for cuda:r)."""
    return _STAND_IN is not None


# ------------------------------------------------------------------------------------ which device
def cuda_present() -> bool:
    """Does this machine have a CUDA device torch can use? (What a GPU node answers yes to.)"""
    return torch.cuda.is_available()


def gpus() -> list[dict[str, Any]]:
    """The CUDA devices of this machine: index, name, memory (GB), compute capability."""
    out = []
    for index in range(torch.cuda.device_count() if cuda_present() else 0):
        props = torch.cuda.get_device_properties(index)
        out.append({"index": index, "name": props.name, "memory_gb": round(props.total_memory / 1e9, 1),
                    "capability": [props.major, props.minor]})
    return out


def is_gpu(device: torch.device | str | None) -> bool:
    """Does a run on `device` take the GPU branch? A CUDA device, or the CPU standing in for one."""
    if device is None:
        return cuda_present() or standing_in()
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and standing_in())


def logical(device: torch.device | str) -> str:
    """The device the node would use: 'cuda:r' for the rehearsal's stand-in, else the device itself."""
    device = torch.device(device)
    if device.type == "cpu" and standing_in():
        return f"cuda:{_STAND_IN.local_rank}"
    return str(device)


def mesh_device_type(device: torch.device | str) -> str:
    """The device type a DeviceMesh of a run on `device` has on the node ('cuda' or 'cpu')."""
    return "cuda" if is_gpu(device) else torch.device(device).type


def default() -> torch.device:
    """This process's compute device when no run says: cuda (a GPU, or its stand-in), else cpu."""
    if cuda_present():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def for_rank(profile, local_rank: int = 0) -> torch.device:
    """The device of local rank `local_rank` of a run on `profile`: cuda:<local_rank> (made current with
    `torch.cuda.set_device`) on a GPU profile, else the CPU. Rehearsal: records the set_device and
    returns the CPU standing in for it; a rank the node has no GPU for fails as it would on the node."""
    global _STAND_IN
    if profile.device != "cuda":
        return torch.device("cpu")
    if not rehearsing():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    if local_rank >= profile.nproc:
        raise RuntimeError(f"CUDA error: invalid device ordinal (rehearsal of {profile.name}: local rank "
                           f"{local_rank} asks for cuda:{local_rank}, the node has {profile.nproc} GPU(s))")
    _STAND_IN = _StandIn(profile.name, profile.gpu_name, int(profile.gpu_memory_gb * 1e9), profile.nproc,
                         local_rank)
    _guard_meshes()
    record("set_device", device=f"cuda:{local_rank}", profile=profile.name)
    return torch.device("cpu")


def resolve(device: torch.device | str) -> torch.device:
    """The torch device for a device name a caller gives ('cuda', 'cuda:1', 'cpu'); in a rehearsal a
    CUDA name is the CPU standing in for it (recorded)."""
    global _STAND_IN
    device = torch.device(device)
    if device.type != "cuda" or not rehearsing():
        return device
    if _STAND_IN is None:
        _STAND_IN = _StandIn(local_rank=device.index or 0)
        _guard_meshes()
    # 'cuda' with no index is the current device: cuda:<local rank> once for_rank made it current
    index = device.index if device.index is not None else _STAND_IN.local_rank
    record("set_device", device=f"cuda:{index}")
    return torch.device("cpu")


def stop_standing_in() -> None:
    """Forget the stand-in (tests; the rehearsal's in-process launcher between ranks)."""
    global _STAND_IN
    _STAND_IN = None


def place(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`module.to(device)`; rehearsal: records where the node puts it."""
    if standing_in():
        record("place", device=logical(device), module=type(module).__name__)
    return module.to(device)


# ------------------------------------------------------------------------------------ process groups
def backend(profile) -> str:
    """The torch.distributed backend of the profile's ranks (nccl on GPUs, gloo on CPU)."""
    return profile.backend


def join_group(profile, rank: int, world: int, *, local_rank: int = 0, timeout_s: float = 1800.0,
               fake: bool = False):
    """(device, world group) of this rank: the device from `for_rank`, the profile's backend with the
    device bound (`device_id`, NCCL's eager init). Rehearsal: records the nccl group and joins gloo
    (real ranks) or, with `fake`, torch's fake process group (rank `rank` of `world` in one process)."""
    import torch.distributed as dist

    device = for_rank(profile, local_rank)
    timeout = _dt.timedelta(seconds=timeout_s)
    if fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore(), timeout=timeout)
    elif standing_in():
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend(profile), rank=rank, world_size=world, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    if standing_in():
        record("init_process_group", backend=backend(profile), device_id=logical(device), world_size=world,
               stand_in="fake" if fake else "gloo")
    return device, dist.group.WORLD


def mesh(device: torch.device | str, shape: tuple[int, ...], names: tuple[str, ...] | None = None):
    """`init_device_mesh` of the device type a run on `device` uses on the node; rehearsal: records
    it and builds the same mesh on the CPU (over the stand-in group)."""
    kind = mesh_device_type(device)
    if standing_in():
        record("mesh", device_type=kind, shape=list(shape), names=list(names or ()))
        kind = "cpu"
    built = _ORIGINAL_INIT_MESH(kind, tuple(shape), mesh_dim_names=names)
    _MESHES.append(built)
    return built


#: Meshes built in this process, oldest first (`release_meshes` destroys their groups).
_MESHES: list = []


def release_meshes(keep: int = 0) -> int:
    """Destroy the process groups of the meshes built after the first `keep` (not the world group):
    an NCCL communicator holds GPU memory `max_memory_allocated` does not see until it is destroyed,
    so each run of a multi-run launch hands its groups back (issue #25, finding 16). Returns how many
    groups were destroyed. Unverified on hardware: the memory freed by destroying NCCL communicators."""
    import torch.distributed as dist

    done, seen = 0, set()
    while len(_MESHES) > keep:
        built = _MESHES.pop()
        if not dist.is_initialized():
            continue
        for dim in range(built.ndim):
            group = built.get_group(dim)
            if group is dist.group.WORLD or group == dist.distributed_c10d._get_default_group() or id(group) in seen:
                continue
            seen.add(id(group))
            with contextlib.suppress(ValueError, RuntimeError):  # already destroyed with another mesh
                dist.destroy_process_group(group)
                done += 1
    if done and standing_in():
        record("destroy_groups", count=done)
    return done


def abort_groups(keep: int = 0) -> bool:
    """After a failure on this rank: forget the meshes built after the first `keep` WITHOUT destroying
    their groups, and abort this rank's NCCL communicators. `destroy_process_group` after a rank raised
    waits for peers still inside a collective (pytorch#141510: the job hangs until the timeout); an
    abort ends this rank's pending NCCL work at once, and the launcher stops the peers (issue 38, G4).
    gloo (CPU, rehearsal) has no abort: the groups are left to the process's exit. Returns whether NCCL
    was aborted. Unverified on hardware: `_abort_process_group` is torch's experimental, private API."""
    import torch.distributed as dist

    del _MESHES[keep:]
    if standing_in():
        record("abort_groups", keep=keep)
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return False
    with contextlib.suppress(RuntimeError, ValueError):  # already aborted by NCCL's watchdog
        dist.distributed_c10d._abort_process_group()
    return True


def mesh_count() -> int:
    return len(_MESHES)


def _init_device_mesh_guard(device_type, *args, **kwargs):
    """torch's `init_device_mesh` while a GPU profile is rehearsed: a 'cpu' mesh there is a bug the node
    shows as a device mismatch (the ranks' models are on cuda:r), so it fails here too."""
    if standing_in() and str(device_type) == "cpu":
        raise RuntimeError(f"rehearsal of {_STAND_IN.profile}: a 'cpu' DeviceMesh, but this rank's model is on "
                           f"cuda:{_STAND_IN.local_rank} on the node (device mismatch); build meshes with "
                           "labkit.runtime.device.mesh(device, shape) or the run's device type")
    return _ORIGINAL_INIT_MESH(device_type, *args, **kwargs)


def _guard_meshes() -> None:
    from torch.distributed import device_mesh

    if device_mesh.init_device_mesh is not _init_device_mesh_guard:
        device_mesh.init_device_mesh = _init_device_mesh_guard


def _original_init_mesh():
    from torch.distributed import device_mesh
    return device_mesh.init_device_mesh


_ORIGINAL_INIT_MESH = _original_init_mesh()


def ddp_device_ids(device: torch.device) -> list | None:
    """DDP's `device_ids`: [cuda:r] on a GPU, None on CPU (gloo)."""
    if standing_in():
        record("ddp", device_ids=[logical(device)])
        return None
    return [device] if is_gpu(device) else None


def stand_in_ddp(ddp):
    """A DDP module as is -- except over a rehearsal's fake process group, which completes no collective
    DDP could read back: there its gradient buckets come back unreduced (torch's no-op comm hook)."""
    import torch.distributed as dist

    if dist.get_backend(ddp.process_group) == "fake":
        from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
        ddp.register_comm_hook(None, noop_hook)
    return ddp


def pin_memory(device: torch.device | str) -> bool:
    """Page-locked host buffers for copies to `device`: on GPUs only (pinning needs the CUDA driver)."""
    if standing_in():
        record("pin_memory", device=logical(device))
        return False
    return is_gpu(device) and cuda_present()


# ------------------------------------------------------------------------------------ numerics
def configure(device: torch.device, *, tf32: bool = False, cudnn_benchmark: bool = True) -> None:
    """GPU runs: cuDNN autotuning on, and fp32 really fp32 unless `tf32` (cuDNN's convolutions default
    to TF32, which made an "fp32" ResNet baseline run TF32 convolutions: issue #25, finding 8). Uses
    torch's fp32_precision switches (matmul and cuDNN conv/RNN: 'ieee' = fp32, 'tf32'). CPU: nothing."""
    if not is_gpu(device):
        return
    precision = "tf32" if tf32 else "ieee"
    torch.backends.cudnn.benchmark = cudnn_benchmark
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision
    torch.backends.cudnn.rnn.fp32_precision = precision
    if standing_in():
        record("configure", device=logical(device), fp32_precision=precision, cudnn_benchmark=cudnn_benchmark)


def tf32_enabled() -> bool:
    """True if fp32 matmuls or cuDNN convolutions may run as TF32 (MFU then uses the TF32 peak)."""
    return "tf32" in (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) \
        or torch.get_float32_matmul_precision() != "highest"


def autocast(device: torch.device, dtype: torch.dtype):
    """`torch.autocast` for a run on `device` (CPU autocast in a rehearsal: bf16 and fp16 both run there)."""
    if standing_in():
        record("autocast", device_type="cuda", dtype=str(dtype).replace("torch.", ""))
    return torch.autocast(torch.device(device).type, dtype=dtype)


def grad_scaler(device: torch.device) -> "torch.amp.GradScaler":
    """fp16's loss scaler on the run's device type (the CPU's own GradScaler in a rehearsal)."""
    if standing_in():
        record("grad_scaler", device_type="cuda")
    return torch.amp.GradScaler(torch.device(device).type)


# ------------------------------------------------------------------------------------ the GPU itself
def total_memory(device: torch.device | str) -> int:
    """Bytes of the GPU (`get_device_properties(...).total_memory`)."""
    if standing_in() and is_gpu(device):
        return _STAND_IN.memory_bytes
    return int(torch.cuda.get_device_properties(device).total_memory)


def device_name(device: torch.device | str) -> str:
    """The GPU's name (`torch.cuda.get_device_name`), 'cpu' on CPU; rehearsal: the profile's GPU."""
    if standing_in() and is_gpu(device):
        return _STAND_IN.gpu_name
    return torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"


def rng_state(device: torch.device | str):
    """The GPU's RNG state (checkpoints carry it), None on CPU."""
    if standing_in() and is_gpu(device):
        record("get_rng_state", device=logical(device))
        return torch.get_rng_state()
    return torch.cuda.get_rng_state(device) if torch.device(device).type == "cuda" else None


def set_rng_state(state, device: torch.device | str) -> None:
    if standing_in() and is_gpu(device):
        record("set_rng_state", device=logical(device))
    elif state is not None and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(state, device)
