"""What labkit's training loop builds for a run, handed to a student's own loop ("write it, compare").

`library_parts("ddp", "tiny-resnet", profile="smoke", dp_rank=r, dp_size=2)` returns the resolved
config, the task, the single-device model (seeded as the loop seeds it), the loop's optimizer and an
iterator over this data-parallel rank's batches of steps 0, 1, ... -- so a hand-written step that does
the same math reproduces `run(...)`'s losses loss for loss. Used by notebooks 02_single_gpu and 03_ddp.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch


@dataclass
class LibraryParts:
    cfg: Any
    """The resolved TrainConfig `run(strategy, model, **options)` would train."""
    task: Any
    """labkit.train.data.Task: `task.loss(model, inputs, targets)` is the loop's loss."""
    model: torch.nn.Module
    """The single-device model before any strategy wraps it (no DDP, no checkpointing)."""
    optimizer: torch.optim.Optimizer
    batches: Iterator
    """(inputs, targets) of this dp rank for steps 0, 1, ...: its share of each global batch."""


def library_parts(strategy: str, model: str, *, dp_rank: int = 0, dp_size: int = 1,
                  device: torch.device | str | None = None, **options) -> LibraryParts:
    """The parts labkit's loop builds for `run(strategy, model, **options)` on data-parallel rank
    `dp_rank` of `dp_size` (`options` as for `run`: profile, batch, lr, amp, accum, ...).

    `device` defaults to the profile's: CPU, or cuda:<dp_rank> on a GPU profile (one GPU per rank;
    unverified on hardware here)."""
    from labkit.runtime import device as devices
    from labkit.zoo.models import build_model
    from labkit.optim import build_optimizer
    from labkit.profiles import get_profile
    from labkit.train.api import make_config
    from labkit.train.data import StepLoader, build_datasets, make_task
    from labkit.train.loop import seed_everything

    nproc = options.pop("nproc", dp_size)
    cfg = make_config(strategy, model, nproc=nproc, rehearse_as="library_parts", **options)
    if device is None:  # this rank's GPU (labkit.runtime.device: a rehearsal records it and computes on the CPU)
        device = devices.for_rank(cfg.profile, dp_rank)
    seed_everything(cfg.run.seed)  # what the loop does first
    task = make_task(cfg)
    net = devices.place(build_model(cfg.run.model, seed=cfg.run.seed), device)
    optimizer = build_optimizer(cfg.optim.optimizer or "adamw", [p for p in net.parameters() if p.requires_grad], cfg.optim.lr)
    train_set, _ = build_datasets(cfg, task)
    loader = StepLoader(train_set, global_batch=cfg.optim.batch, dp_rank=dp_rank, dp_size=dp_size, seed=cfg.run.seed,
                        workers=cfg.run.workers)
    batches = ((x.to(device), y.to(device)) for x, y in loader)
    return LibraryParts(cfg, task, net, optimizer, batches)
