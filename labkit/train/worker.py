"""Per-rank entry point under torchrun: `python -m labkit.train.worker --config-json '{...}'`.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR; this module turns them into a
`DistContext` (the world group is passed down explicitly, never looked up as a global), runs the
loop and tears the group down. `@record` writes the rank's traceback to torchrun's error.json, which
`labkit.launch` turns into a `LaunchError` naming the failing rank. Introduced in notebook 03_ddp.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from labkit import device as devices
from labkit.parallel.single import DistContext
from labkit.profiles import get_profile
from labkit.train.config import TrainConfig
from labkit.train.loop import train


def init_distributed(cfg: TrainConfig) -> DistContext:
    """Join the job's process group (gloo on CPU, nccl on GPUs) and pick this rank's device."""
    prof = get_profile(cfg.run.profile)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device, group = devices.join_group(prof, rank, world, local_rank=local_rank, timeout_s=prof.timeout_s)
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=device, group=group)


def local_context(cfg: TrainConfig) -> DistContext:
    """The context of an in-process, single-device run (no process group)."""
    return DistContext(rank=0, world_size=1, local_rank=0, device=devices.for_rank(get_profile(cfg.run.profile)),
                       group=None)


@record
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="labkit.train.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--config-json", required=True, help="a resolved TrainConfig as JSON")
    cfg = TrainConfig.from_json(parser.parse_args(argv).config_json)
    ctx = init_distributed(cfg)
    try:
        train(cfg, ctx)
    finally:
        dist.destroy_process_group()
    exit_now()


def exit_now() -> None:
    """Leave a finished rank without the interpreter's teardown.

    Everything is written and the process group is destroyed; what is left is destroying C++
    objects (gloo / FSDP / DeepSpeed threads) in arbitrary order, which now and then aborts with
    "terminate called without an active exception" -- a failed rank for torchrun after a good run.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
