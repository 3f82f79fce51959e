"""Parallelism strategies: the registry, and the contract between them and the one training loop.

Every `labkit train --strategy S` goes through the SAME loop (`labkit.train.loop.train`). A strategy
changes only what the loop delegates to its hook object, a `Strategy` (defined in
`labkit/parallel/single.py`, re-exported here). Introduced in notebooks 02_single_gpu and 03_ddp.

THE CONTRACT (what a strategy module `labkit/parallel/<x>.py` provides)
-----------------------------------------------------------------------
1. `apply_<x>(model, mesh_or_group, *, cfg) -> nn.Module`: the one public transform (STYLE.md #1),
   e.g. `apply_ddp(model, group, cfg=cfg)`. `cfg` is the run's `labkit.train.TrainConfig`.
2. `STRATEGY_CLASSES: dict[str, type[Strategy]]`: the hook class for each registry name the module
   serves (one module serves its variants: `fsdp.py` maps 'fsdp', 'fsdp-grad-op', 'fsdp-offload', ...).
   The loop builds the hook as `cls(name, ctx, cfg, task)`: `ctx` is a `DistContext` (rank, world
   size, device, the world process group -- never a global), `task` a `labkit.train.data.Task` (the
   model kind's loss and data).
3. The hook subclasses `Strategy` and overrides only what differs. The loop calls, in this order:

   before launch  `check(cfg, world_size)` (classmethod): ConfigError for settings it cannot run.
                  Default: at most `max_world_size` ranks; batch % (dp_size_for(cfg, world) * accum) == 0.
                  `launch_env(cfg)` (classmethod): extra env for the ranks (DeepSpeed: DS_ACCELERATOR=cpu).
                  `needs_process_group`: False only for 'single', which runs in the caller's process.
   topology       `dims` (a `ParallelDims`, labkit/parallel/dims.py: the registry name's preset, from
                  the classmethod `dims_for(cfg, world)`) and from it `dp_rank`, `dp_size` (attributes, set
                  in __init__): how the GLOBAL batch is sharded. ddp / fsdp / zero: rank / world size;
                  tensor-fsdp: the dp coordinate of the (dp_shard, tp) mesh (TP ranks of one dp group get
                  the SAME samples); pipeline / context parallel: 0 / 1. `dp_size_for` = dims' dp_size.
                  Meshes come from `self.dims.build_mesh(device_type, names)`.
   setup()        sets `self.model` and `self.optimizer`:
                  `build_model()`        default `labkit.zoo.models.build_model(cfg.run.model)` on ctx.device;
                                         lora/qlora load and adapt the model themselves (4-bit from_pretrained).
                  `parallelize(model)`   default: channels_last -> activation checkpointing -> `wrap` ->
                                         compile. Tensor parallel overrides the order (TP first, then
                                         checkpointing, compile, FSDP: torchtitan's order).
                  `wrap(model)`          `apply_<x>(model, ctx.group or a mesh, cfg=cfg)`: DDP, fully_shard, ...
                  `build_optimizer(model)` default `labkit.optim.build_optimizer(cfg.optim.optimizer, trainable, lr)`.
                  DeepSpeed overrides `setup` itself (`deepspeed.initialize` returns the engine that owns
                  the optimizer); `self.model` is then the engine.
   each step      `train_step(micro_batches, loss_fn)` -> this rank's loss (detached tensor) or None when
                  the rank has no loss (pipeline stages before the last). `micro_batches` is a list of
                  `accum` (inputs, targets) pairs already on ctx.device; `loss_fn(model, inputs, targets)`
                  is `task.loss` (mean cross-entropy). Default: zero_grad; for each micro-batch, under
                  `no_sync()` except the last: forward under `precision.autocast()`, `backward(loss / accum)`;
                  then `optimizer_step()`. Override the small pieces (`no_sync`: DDP's `model.no_sync()`;
                  `backward`/`optimizer_step`: `engine.backward(loss)` / `engine.step()`) or the whole
                  step (pipeline: `schedule.step(...)` runs all micro-batches, the last stage returns the loss).
                  `precision` (levers.Precision) is the autocast + GradScaler of cfg.precision.amp.
   end of run     `evaluate(batches)` -> {'loss_sum', 'correct', 'count'} on held-out batches, or None.
                  `resident_bytes()` -> ResidentBytes(param, grad, optimizer, cpu_offload): tensors on
                  ctx.device (DTensors by local shard), host bytes of offloading strategies.
                  `trainable_params()`, `flops_per_step(global_tokens)` (6 N tokens for LLMs; None = the
                  loop measures with FlopCounterMode), `record_facts()` -> {group: labkit.facts} (extend super()'s).
   checkpoints    `save_checkpoint(folder)` / `load_checkpoint(folder)`: collective; default DCP of
                  `state_dict()` = `get_state_dict(model, optimizer)` (handles DDP prefixes and FSDP2
                  DTensors, and reshards on load) + per-rank RNG / loss-scaler state. DeepSpeed uses the
                  engine's own save/load_checkpoint into the same folder. The loop makes it atomic.
   teardown       `close()`.

Rules every strategy keeps, so runs compare loss for loss (`labkit.results.compare`):
- The GLOBAL batch of step k is the same samples for any world size: the loop's data sharding uses the
  hook's `dp_rank`/`dp_size` (TP ranks of one dp group see the SAME batch).
- The loss of a step is the mean over the global batch: each micro-batch loss is divided by `accum`
  and data-parallel gradients are AVERAGED over dp ranks, so the update equals the single-process one.
- fp32 in the smoke profile; bytes counted on the rank's own device; rank 0 alone prints and writes.
- No process-group globals: use `ctx.group` or a mesh from `self.dims.build_mesh(...)`.
- A module starts with its teachable part (`apply_<x>` on the first screen); measurement and
  orchestration around strategies (sweeps, studies, byte comparisons) live in `labkit/parallel/studies.py`.

Names not implemented yet are registered and fail with a clear "not available yet" error.
"""
from __future__ import annotations

import importlib
import importlib.util
from types import MappingProxyType

from labkit.errors import ConfigError

#: strategy name -> module under labkit.parallel that implements it (its `STRATEGY_CLASSES`), and the
#: course issue that brings it. Names are fixed here so the CLI lists and checks all of them.
STRATEGIES = MappingProxyType({
    "single": ("single", "training harness"),
    "ddp": ("ddp", "training harness"),
    **{n: ("fsdp", "sharding") for n in ("fsdp", "fsdp-grad-op", "fsdp-no-shard", "fsdp-hybrid", "fsdp-offload")},
    **{n: ("zero", "sharding") for n in ("zero1", "zero2", "zero3", "zero3-offload")},
    "lora": ("peft", "PEFT"), "qlora": ("qlora", "PEFT"),
    **{n: ("pipeline", "model-parallel") for n in ("pipeline-gpipe", "pipeline-1f1b")},
    **{n: ("pipeline_virtual", "beyond 3-D") for n in ("pipeline-interleaved", "pipeline-zero-bubble")},
    **{n: ("tensor", "model-parallel") for n in ("tensor", "tensor-fsdp")},
    **{n: ("stack", "profiling and stacking") for n in ("fsdp-qlora", "fsdp-qlora-offload")},
    "context-parallel": ("context", "beyond 3-D"),
    "expert-parallel": ("expert", "beyond 3-D"),
})

_LAZY = {"Strategy", "DistContext", "ResidentBytes"}


def check_name(name: str) -> None:
    """ConfigError listing every valid strategy if `name` is not one (no torch import)."""
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; valid strategies are: {', '.join(STRATEGIES)}")


def strategy_class(name: str):
    """The `Strategy` subclass serving `name`; ConfigError when its module is not in this labkit yet."""
    check_name(name)
    module, issue = STRATEGIES[name]
    full = f"labkit.parallel.{module}"
    cls = None
    if importlib.util.find_spec(full) is not None:
        cls = getattr(importlib.import_module(full), "STRATEGY_CLASSES", {}).get(name)
    if cls is None:
        ready = ", ".join(n for n in STRATEGIES if is_available(n))
        raise ConfigError(f"strategy {name!r} is not available yet in this labkit (it comes with the {issue} "
                          f"issue as {full}); available now: {ready}")
    return cls


def is_available(name: str) -> bool:
    """True when strategy `name`'s module exists and registers a hook class for it."""
    full = f"labkit.parallel.{STRATEGIES[name][0]}"
    if importlib.util.find_spec(full) is None:
        return False
    return name in getattr(importlib.import_module(full), "STRATEGY_CLASSES", {})


def make_strategy(name: str, ctx, cfg, task):
    """The hook for strategy `name` on this rank (imports the strategy module lazily)."""
    return strategy_class(name)(name, ctx, cfg, task)


def __getattr__(attr: str):
    # Strategy / DistContext live in single.py (they import torch); keep `labkit.parallel` itself
    # torch-free so the CLI can list and check strategy names cheaply.
    if attr in _LAZY:
        return getattr(importlib.import_module("labkit.parallel.single"), attr)
    raise AttributeError(f"module 'labkit.parallel' has no attribute {attr!r}")
