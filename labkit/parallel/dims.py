"""The topology of a run: how many ranks each parallelism dimension gets, validated once.

One frozen `ParallelDims` (torchtitan's `ParallelDims` is the model) answers every question about the
layout of the ranks, for the runtime (the DeviceMesh a strategy builds, which samples a rank reads),
the memory estimator (`labkit.memory.estimate.check_topology`) and the planner (`labkit.parallel.planner`):

    world = pp x dp_replicate x dp_shard x cp x tp        (the mesh, outermost dim first)
    dp    = dp_replicate x dp_shard                       (ranks that read DIFFERENT samples)

tp is innermost: ranks r..r+tp-1 form one tensor-parallel group, which on a GPU node are the GPUs one
NVLink switch connects (Narayanan et al. 2021, Sec. 3). ep is not a factor of the world: the experts
of an MoE model are split over ep of the data-parallel ranks (GShard), so ep divides dp.

Every registry name of `labkit.parallel.STRATEGIES` is a preset of dims (`from_world`): 'ddp' is
dp_replicate = world, 'fsdp' dp_shard = world, 'fsdp-hybrid' (HSDP) dp_replicate = nodes x dp_shard =
ranks per node, 'tensor-fsdp' dp_shard x tp, 'pipeline-*' pp = world, ... Pure Python: torch is
imported only to build a mesh. Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from labkit.errors import ConfigError, choices_error

#: Mesh dimension order, outermost first (torchtitan's): pipeline stages across nodes, TP innermost.
ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DP_DIMS = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallelism dimension. Build one with `from_world(name, world)` or directly."""

    dp_replicate: int = 1
    """Data-parallel replicas: a full copy of the (sharded) model each, gradients all-reduced (DDP; HSDP's
    outer dim)."""
    dp_shard: int = 1
    """Data-parallel ranks that shard parameters, gradients and optimizer states (FSDP / ZeRO)."""
    tp: int = 1
    """Tensor-parallel degree: every linear split over tp ranks (Megatron-LM)."""
    pp: int = 1
    """Pipeline stages: the layers split over pp ranks."""
    cp: int = 1
    """Context-parallel degree: every sequence split over cp ranks (ring attention)."""
    ep: int = 1
    """Expert-parallel degree: the experts of an MoE model split over ep data-parallel ranks; divides dp."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{f.name}={value!r}; every parallel degree must be a positive integer "
                                  f"(use {f.name}=1 to leave that dimension out)")
        if self.dp_size % self.ep:
            raise ConfigError(f"ep={self.ep} must divide dp={self.dp_size}: the experts are split over data-parallel "
                              f"ranks; use an ep that divides {self.dp_size}, or raise dp")

    # ------------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_size(self) -> int:
        """Ranks that read different samples: the global batch is split dp ways."""
        return self.dp_replicate * self.dp_shard

    @property
    def model_parallel(self) -> int:
        """Ranks that share one replica's work on the same samples (tp x pp x cp)."""
        return self.tp * self.pp * self.cp

    def check_world(self, world: int, *, label: str = "world size") -> "ParallelDims":
        """ConfigError unless the degrees multiply to `world`, naming the product (returns self)."""
        if self.world_size == world:
            return self
        cp = f" * cp({self.cp})" if self.cp > 1 else ""
        model = self.model_parallel
        if world % model == 0:
            hint = f"; e.g. dp={world // model} with tp={self.tp}, pp={self.pp}" + (f", cp={self.cp}" if cp else "")
        else:
            hint = f"; tp*pp{'*cp' if cp else ''}={model} does not divide {world}"
        raise ConfigError(f"tp({self.tp}) * pp({self.pp}){cp} * dp({self.dp_size}) = {self.world_size} != "
                          f"{label}({world}): the degrees must multiply to the GPU count{hint}")

    # ------------------------------------------------------------------ where a rank sits
    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank `rank`'s index along each mesh dim (row-major over ORDER, tp fastest)."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside a world of {self.world_size} ranks")
        out = {}
        for name in reversed(ORDER):
            rank, out[name] = divmod(rank, getattr(self, name))
        return {name: out[name] for name in ORDER}

    def dp_rank(self, rank: int) -> int:
        """Which slice of the global batch rank `rank` reads (TP / PP / CP ranks of one replica: the same)."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    # ------------------------------------------------------------------ the DeviceMesh
    def mesh_shape(self, names: tuple[str, ...] | None = None) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """(shape, dim names) of the mesh over the named dims (default: those > 1, or the 1-D dp_shard mesh).

        Name size-1 dims explicitly when an API wants them: FSDP2 shards over the LAST dim of a 2-D
        mesh and replicates over the first, so NO_SHARD is the mesh (world, 1) ('dp_replicate', 'dp_shard').
        """
        if names is None:
            names = tuple(n for n in ORDER if getattr(self, n) > 1) or ("dp_shard",)
        unknown = [n for n in names if n not in (*ORDER, "ep")]
        if unknown:
            raise ConfigError(f"unknown mesh dim(s) {unknown}; valid: {', '.join((*ORDER, 'ep'))}")
        shape = tuple(getattr(self, n) for n in names)
        if math.prod(shape) != self.world_size:
            raise ConfigError(f"mesh dims {names} of sizes {shape} do not cover the {self.world_size} ranks of "
                              f"{self}; name every dimension > 1")
        return shape, tuple(names)

    def build_mesh(self, device, names: tuple[str, ...] | None = None):
        """The DeviceMesh over the job's ranks with named dims (built from the process group torchrun set up;
        `mesh["tp"]` is this rank's TP group), of the device type of the run's `device` (`ctx.device`:
        `labkit.runtime.device.mesh`, which a rehearsal records). Collective: every rank calls it."""
        from labkit.runtime import device as devices

        shape, names = self.mesh_shape(names)
        return devices.mesh(device, shape, names)

    # ------------------------------------------------------------------ presets
    @classmethod
    def from_world(cls, strategy: str, world: int, *, nnodes: int = 1, tp: int | None = None) -> "ParallelDims":
        """The dims of registry name `strategy` on `world` ranks (`nnodes` nodes; `tp` for tensor-fsdp,
        default the ranks of one node)."""
        if not isinstance(world, int) or world < 1:
            raise ConfigError(f"world size {world!r}; it must be a positive integer")
        if strategy not in PRESETS:
            raise choices_error("ParallelDims preset", strategy, PRESETS)
        return PRESETS[strategy](world, nnodes, tp or max(1, world // nnodes)).check_world(world)

    @classmethod
    def for_config(cls, cfg, world: int, name: str | None = None) -> "ParallelDims":
        """The dims of a resolved TrainConfig on `world` ranks (its strategy, --nnodes, --nproc as TP size)."""
        tp = getattr(cfg, "tp", None) or getattr(getattr(cfg, "launch", None), "nproc", None)
        return cls.from_world(name or cfg.run.strategy, world, nnodes=getattr(getattr(cfg, "launch", None), "nnodes", 1) or 1, tp=tp)


def dp_of_mesh(mesh) -> tuple[int, int]:
    """(dp rank, dp size) of this rank from a built DeviceMesh: its coordinates along the data-parallel
    dims it has ('dp_replicate', 'dp_shard'; 'dp' too), (0, 1) when it has none."""
    rank, size = 0, 1
    for name in mesh.mesh_dim_names or ():
        if name in (*DP_DIMS, "dp"):
            n = mesh.size(mesh.mesh_dim_names.index(name))
            rank, size = rank * n + mesh.get_local_rank(name), size * n
    return rank, size


# ------------------------------------------------------------------------------------------ presets
def _single(world: int, nnodes: int, tp: int) -> ParallelDims:
    if world != 1:
        raise ConfigError(f"strategy 'single' runs 1 process, not {world}; use --nproc 1 or a data-parallel "
                          "strategy such as --strategy ddp")
    return ParallelDims()


def _hybrid(world: int, nnodes: int, tp: int) -> ParallelDims:
    if world % nnodes:
        raise ConfigError(f"fsdp-hybrid: {world} ranks do not split into {nnodes} nodes; "
                          "use the same --nproc on every node")
    return ParallelDims(dp_replicate=nnodes, dp_shard=world // nnodes)


def _tensor_fsdp(world: int, nnodes: int, tp: int) -> ParallelDims:
    tp = max(1, min(tp, world))  # TP inside a node (tp = --nproc), FSDP across
    if world % tp:
        raise ConfigError(f"{world} ranks do not form whole TP groups of {tp}; use --nproc {tp} per node")
    return ParallelDims(dp_shard=world // tp, tp=tp)


def _replicate(world, nnodes, tp):
    return ParallelDims(dp_replicate=world)


def _shard(world, nnodes, tp):
    return ParallelDims(dp_shard=world)


#: registry name -> dims on (world, nnodes, tp) ranks. ZeRO shards like FSDP (stage 1 the optimizer
#: only, but every stage splits over all ranks); lora / qlora replicate (DDP) or, with --lora-parallel
#: fsdp, shard: the same dp size either way.
PRESETS = {
    "single": _single,
    "ddp": _replicate, "lora": _replicate, "qlora": _replicate,
    "fsdp-no-shard": _replicate,
    **dict.fromkeys(("fsdp", "fsdp-grad-op", "fsdp-offload", "fsdp-qlora", "fsdp-qlora-offload"), _shard),
    **dict.fromkeys(("zero1", "zero2", "zero3", "zero3-offload"), _shard),
    "fsdp-hybrid": _hybrid,
    "tensor": lambda world, nnodes, tp: ParallelDims(tp=world),
    "tensor-fsdp": _tensor_fsdp,
    **dict.fromkeys(("pipeline-gpipe", "pipeline-1f1b", "pipeline-interleaved", "pipeline-zero-bubble"),
                    lambda world, nnodes, tp: ParallelDims(pp=world)),
    "context-parallel": lambda world, nnodes, tp: ParallelDims(cp=world),
    "expert-parallel": lambda world, nnodes, tp: ParallelDims(dp_replicate=world, ep=world),
}
