"""Fully sharded data parallel with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Zhao et al. 2023, "PyTorch FSDP" (VLDB): every rank keeps 1/N of each parameter, gradient and
optimizer state (ZeRO-3, Rajbhandari et al. 2020). Before a unit (a group of modules: one
transformer block) runs, its parameters are all-gathered; after it ran they are freed again
(`reshard_after_forward=True`), and its gradients are reduce-scattered so each rank keeps only its
shard. Per rank and step that moves 3 x (N-1)/N x Psi bytes instead of DDP's 2 x (N-1)/N x Psi
(ZeRO paper, Sec. 7.2.2: 1.5x the communication of data parallelism) -- per micro-batch: with K
accumulated micro-batches FULL_SHARD gathers and reduce-scatters K times, ~1.5K x DDP's bytes, unless
gradients stay unsharded through the accumulation (`comm.dp_traffic_vs_ddp`).

The registry names map onto ZeRO stages (see docs/sharding.md):

| name           | FSDP1 / accelerate sharding_strategy | mesh                         | ZeRO  |
|----------------|--------------------------------------|------------------------------|-------|
| fsdp           | FULL_SHARD                           | 1-D (dp_shard=N)             | 3     |
| fsdp-grad-op   | SHARD_GRAD_OP                        | 1-D, reshard_after_forward=False | 2 |
| fsdp-no-shard  | NO_SHARD                             | 2-D (dp_replicate=N, dp_shard=1) | 0 (DDP) |
| fsdp-hybrid    | HYBRID_SHARD                         | 2-D (nodes, ranks per node)  | 3 in a node, replicated across |
| fsdp-offload   | FULL_SHARD + offload_params          | 1-D + CPUOffloadPolicy       | 3 + offload |

Introduced in notebook 04_fsdp.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from labkit.runtime import device as devices
from labkit.errors import ConfigError, choices_error
from labkit.parallel import comm, loading
from labkit.parallel.dims import DP_DIMS, ParallelDims
from labkit.parallel.single import Strategy
from labkit.train.metrics import ResidentBytes, tensor_bytes

WRAP_POLICIES = ("block", "size", "root")
MESHES = ("shard", "replicate", "hybrid")


def apply_fsdp(model: nn.Module, mesh, *, cfg, plan: FsdpPlan | None = None) -> nn.Module:
    """`fully_shard` the wrap units bottom-up, then the root (which takes every remaining parameter).

    The root is resharded after forward too, so between forward and backward a rank holds only its
    shards plus the one unit being computed: the ZeRO-3 working set.
    """
    plan = plan or VARIANTS["fsdp"]
    from torch.distributed.fsdp import fully_shard

    device = torch.device(mesh.device_type)
    kwargs = dict(mesh=mesh, reshard_after_forward=plan.reshard_after_forward,
                  mp_policy=mp_policy_for(getattr(getattr(cfg, "precision", None), "amp", "none")), offload_policy=offload_policy_for(plan, device))
    # Bottom-up: each unit's parameters become DTensors sharded on dim 0 ((d0/N, ...) per rank) and are
    # all-gathered together when the unit runs; the root then takes whatever no unit claimed.
    for unit in wrap_units(model, plan.wrap, plan.min_num_params):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


@dataclass(frozen=True)
class FsdpPlan:
    """How one FSDP variant shards (the knobs FSDP1's `sharding_strategy` bundles together)."""

    mesh: str = "shard"
    """'shard' (1-D over all ranks), 'replicate' (world x 1: NO_SHARD) or 'hybrid' (nodes x ranks per node)."""
    reshard_after_forward: bool = True
    """Free gathered parameters after each unit's forward (ZeRO-3) or keep them until backward (ZeRO-2)."""
    offload: bool = False
    """CPUOffloadPolicy: sharded params, grads and the optimizer step live in host memory."""
    wrap: str = "block"
    """'block' (one unit per transformer block, FSDP1 TRANSFORMER_BASED_WRAP), 'size' (SIZE_BASED_WRAP
    with `min_num_params`) or 'root' (one unit: the whole model is gathered at once)."""
    min_num_params: int = 100_000_000
    """SIZE_BASED_WRAP threshold: a subtree with at least this many unwrapped parameters is a unit."""

    def __post_init__(self) -> None:
        if self.mesh not in MESHES:
            raise choices_error("FSDP mesh", self.mesh, MESHES)
        if self.wrap not in WRAP_POLICIES:
            raise choices_error("FSDP wrap policy", self.wrap, WRAP_POLICIES)
        if not isinstance(self.min_num_params, int) or self.min_num_params < 1:
            raise ConfigError(f"min_num_params={self.min_num_params!r}; it must be a positive integer")


VARIANTS = {
    "fsdp": FsdpPlan(),
    "fsdp-grad-op": FsdpPlan(reshard_after_forward=False),
    "fsdp-no-shard": FsdpPlan(mesh="replicate"),
    "fsdp-hybrid": FsdpPlan(mesh="hybrid"),
    "fsdp-offload": FsdpPlan(offload=True),
}


# ------------------------------------------------------------------------------------------ topology
#: plan.mesh -> (the ParallelDims preset, the mesh dims FSDP2 gets). 2-D meshes are (replicate, shard):
#: FSDP2 shards over the last dim and replicates over the first (HSDP); NO_SHARD is (world, 1).
MESH_DIMS = {"shard": ("fsdp", ("dp_shard",)), "replicate": ("fsdp-no-shard", DP_DIMS),
             "hybrid": ("fsdp-hybrid", DP_DIMS)}


def mesh_shape(plan: FsdpPlan, world_size: int, nnodes: int = 1) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(shape, dim names) of the data-parallel mesh of `plan` on `world_size` ranks (labkit.parallel.dims)."""
    preset, names = MESH_DIMS[plan.mesh]
    return ParallelDims.from_world(preset, world_size, nnodes=nnodes).mesh_shape(names)


def build_mesh(plan: FsdpPlan, device: torch.device, world_size: int, nnodes: int = 1):
    """The DeviceMesh over the job's ranks (built from the world group torchrun set up, no global of ours)."""
    preset, names = MESH_DIMS[plan.mesh]
    return ParallelDims.from_world(preset, world_size, nnodes=nnodes).build_mesh(device, names)


# ------------------------------------------------------------------------------------------ wrapping
def _tied_param_ids(model: nn.Module) -> set[int]:
    """Parameters registered under two names (tied embedding / LM head): they must stay in one unit."""
    seen, tied = set(), set()
    for _, p in model.named_parameters(remove_duplicate=False):
        (tied if id(p) in seen else seen).add(id(p))
    return tied


def wrap_units(model: nn.Module, policy: str = "block", min_num_params: int = 100_000_000) -> list[nn.Module]:
    """The submodules that become FSDP units, in the bottom-up order `fully_shard` needs (root excluded).

    'block': every module whose class is in the model's `_no_split_modules` (HF names its transformer
    block there: LlamaDecoderLayer), like FSDP1's transformer_auto_wrap_policy.
    'size': post-order walk; a subtree holding >= `min_num_params` not-yet-wrapped parameters becomes a
    unit (FSDP1's size_based_auto_wrap_policy). 'root': none, the whole model is one unit.
    """
    if policy not in WRAP_POLICIES:
        raise choices_error("FSDP wrap policy", policy, WRAP_POLICIES)
    if policy == "root":
        return []
    if policy == "block":
        names = set(getattr(model, "_no_split_modules", None) or ())
        units = [m for m in model.modules() if type(m).__name__ in names]
        if not units:
            raise ConfigError(f"{type(model).__name__} names no transformer block in _no_split_modules; "
                              "use wrap='size' with min_num_params instead")
        return units
    tied = _tied_param_ids(model)
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> int:  # returns the unwrapped parameter count of the subtree
        count = sum(visit(child) for child in module.children())
        own = list(module.parameters(recurse=False))
        count += sum(p.numel() for p in own)
        holds_tied = any(id(p) in tied for p in module.parameters())
        if module is not model and count >= min_num_params and not holds_tied:
            units.append(module)
            return 0
        return count

    visit(model)
    return units


def unit_sizes(model: nn.Module, units: list[nn.Module]) -> list[int]:
    """Parameters each FSDP unit gathers at once (nested units excluded), the root's last."""
    assigned: set[int] = set()
    sizes = []
    for unit in [*units, model]:  # bottom-up, as fully_shard assigns them
        own = {id(p): p.numel() for p in unit.parameters() if id(p) not in assigned}
        assigned |= set(own)
        sizes.append(sum(own.values()))
    return sizes


# ------------------------------------------------------------------------------------------ apply
def mp_policy_for(amp: str):
    """MixedPrecisionPolicy: bf16 compute on gathered params, fp32 gradient reduction, fp32 sharded
    masters (Micikevicius et al. 2018). fp16 and fp32 keep fp32 params (autocast + GradScaler do fp16)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if amp == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def offload_policy_for(plan: FsdpPlan, device: torch.device):
    """CPUOffloadPolicy with pinned host memory only where CUDA exists (pinning needs the driver)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not plan.offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=devices.pin_memory(device))


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def comm_bytes_per_step(plan: FsdpPlan, param_bytes: int, shape: tuple[int, ...]) -> dict[str, int]:
    """Bytes each rank sends per optimizer step (ring collectives, (n-1)/n x size each), by collective.

    Full shard: all-gather in forward + again in backward + reduce-scatter of grads = 3 x; grad-op
    skips the backward all-gather (2 x, like DDP's all-reduce = reduce-scatter + all-gather); HSDP adds
    an all-reduce of the gradient shard across the replicas.
    """
    shard = shape[-1]
    replicas = shape[0] if len(shape) == 2 else 1
    ring = comm.bytes_sent("all_gather", param_bytes, shard)  # = reduce-scatter's
    out = {"all_gather": int(ring * (2 if plan.reshard_after_forward else 1)), "reduce_scatter": int(ring)}
    if replicas > 1:
        out["all_reduce"] = int(comm.bytes_sent("all_reduce", param_bytes, replicas) / shard)
    return out


# ------------------------------------------------------------------------------------------ hook
class FSDPStrategy(Strategy):
    """FSDP2 hook: rank-0 loading, `apply_fsdp`, no reduce-scatter on accumulation micro-batches."""

    def __init__(self, name, ctx, cfg, task):
        super().__init__(name, ctx, cfg, task)
        self.plan = VARIANTS[name]
        self.mesh = None
        self.units: list[int] = []
        self._held_after_forward = (0, 0)  # (bytes on device, bytes on host)

    @classmethod
    def check(cls, cfg, world_size: int) -> None:
        super().check(cfg, world_size)
        if cfg.kind != "llm":
            raise ConfigError(f"strategy {cfg.run.strategy!r} shards transformer blocks; use an LLM such as "
                              f"--model tiny-llama, not {cfg.run.model!r} (or --strategy ddp for ResNets)")
        if cfg.run.strategy == "fsdp-hybrid":
            mesh_shape(VARIANTS["fsdp-hybrid"], world_size, cfg.launch.nnodes)

    def build_model(self) -> nn.Module:
        # Rank 0 builds the real model in host memory, the others on the meta device (loading.py).
        return loading.build_on_rank0(self.cfg.run.model, self.ctx.rank, seed=self.cfg.run.seed)

    def wrap(self, model: nn.Module) -> nn.Module:
        full = loading.full_state_on_rank0(model, self.ctx.rank)
        self.mesh = self.dims.build_mesh(self.ctx.device, MESH_DIMS[self.plan.mesh][1])
        units = wrap_units(model, self.plan.wrap, self.plan.min_num_params)
        self.units = unit_sizes(model, units)
        apply_fsdp(model, self.mesh, cfg=self.cfg, plan=self.plan)
        shards_on = torch.device("cpu") if self.plan.offload else self.ctx.device
        loading.load_sharded_from_rank0(model, full, group=self.ctx.group, device=shards_on,
                                        buffers_on=self.ctx.device)  # buffers: on the compute device
        del full
        # Registered after fully_shard, so it runs after FSDP's own post-forward (reshard) hook: it
        # sees what a rank holds between forward and backward (all unsharded params for grad-op).
        model.register_forward_hook(self._after_forward)
        return model

    def _after_forward(self, module, args, output) -> None:
        if module.training and torch.is_grad_enabled():
            held = tensor_bytes(self.model.parameters(), self.ctx.device)
            self._held_after_forward = max(self._held_after_forward, held, key=sum)

    @contextlib.contextmanager
    def no_sync(self):
        # Accumulation micro-batches: gradients accumulate unsharded, the last micro-batch reduce-scatters.
        root = self._unwrapped()
        root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)

    def resident_bytes(self) -> ResidentBytes:
        """Params at their peak between forward and backward (or at rest, whichever is larger), sharded
        grads and optimizer state; with offload, the bytes CPUOffloadPolicy keeps in host memory."""
        for m in fsdp_modules(self.model):
            m.reshard()  # an eval forward with reshard_after_forward=False leaves params gathered
        params = list(self.model.parameters())
        rest = tensor_bytes(params, self.ctx.device)
        grads = tensor_bytes([p.grad for p in params if p.grad is not None], self.ctx.device)
        optim = tensor_bytes([v for s in self.optimizer.state.values() for v in s.values()], self.ctx.device)
        held = self._held_after_forward
        if not devices.is_gpu(self.ctx.device):
            # Host IS the device: nothing moves physically; report what the policy places on host.
            offload = sum(rest) + sum(grads) + sum(optim) if self.plan.offload else 0
            return ResidentBytes(max(sum(rest), sum(held)), sum(grads), sum(optim), offload)
        return ResidentBytes(max(rest[0], held[0]), grads[0], optim[0], rest[1] + grads[1] + optim[1])

    def record_facts(self) -> dict:
        from labkit.facts import CommFacts, MemoryFacts, ShardingFacts
        shape, names = self.dims.mesh_shape(MESH_DIMS[self.plan.mesh][1])
        full_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        mp = mp_policy_for(self.cfg.precision.amp)
        name = lambda dtype: str(dtype or torch.float32).removeprefix("torch.")  # noqa: E731
        sharding = ShardingFacts(mesh_shape=list(shape), mesh_dims=list(names),
                                 reshard_after_forward=self.plan.reshard_after_forward,
                                 wrap_policy=self.plan.wrap, fsdp_units=len(self.units), unit_params=self.units,
                                 param_dtype=name(mp.param_dtype), reduce_dtype=name(mp.reduce_dtype),
                                 master_dtype=name(next(self.model.parameters()).dtype), memory_efficient_loading=True)
        memory = MemoryFacts(param_bytes_after_forward=sum(self._held_after_forward), offload=self.plan.offload)
        if self.plan.offload:
            memory = dataclasses.replace(memory, offload_physical=devices.is_gpu(self.ctx.device),
                                         offload_pin_memory=offload_policy_for(self.plan, self.ctx.device).pin_memory)
        return {"sharding": sharding, "memory": memory,
                "comm": CommFacts.of(comm_bytes_per_step(self.plan, full_bytes, shape))}


STRATEGY_CLASSES = {name: FSDPStrategy for name in VARIANTS}


def plan_for(name: str, **changes) -> FsdpPlan:
    """The plan of registry name `name`, optionally changed (e.g. wrap='size', min_num_params=20_000)."""
    if name not in VARIANTS:
        raise choices_error("FSDP strategy", name, VARIANTS)
    return dataclasses.replace(VARIANTS[name], **changes)
