"""One rank of `labkit.course.exercises.spawn`: `python -m labkit.course.exercises._rank WORKDIR PARENT_PID`.

Ties its life to the parent (parent-death signal + watchdog), initialises gloo from the env rendezvous,
runs the shipped function and writes its return value (or its error) as a pickle into WORKDIR.
"""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path


def main(workdir: str, parent: int) -> int:
    from labkit.runtime import quiet, rank_guard

    rank_guard.set_parent_death_signal()
    if os.getppid() != parent:  # the caller died before the prctl took effect
        return 1
    rank_guard.watch_parent(parent)
    quiet.install()
    import cloudpickle
    import torch.distributed as dist

    work = Path(workdir)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        fn, args, profile = cloudpickle.loads((work / "payload.pkl").read_bytes())
        if profile is None:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        else:  # the profile's backend and this rank's device (labkit.runtime.device; a rehearsal: gloo on CPU)
            from labkit.runtime import device as devices
            from labkit.profiles import get_profile
            devices.join_group(get_profile(profile), rank, world, local_rank=rank)
        try:
            result = fn(rank, world, *args)
        finally:
            sys.stdout.flush()
        (work / f"result_{rank}.pkl").write_bytes(cloudpickle.dumps(result))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the caller, which names this rank
        (work / f"error_{rank}.pkl").write_bytes(cloudpickle.dumps(
            (type(exc).__name__, str(exc), traceback.format_exc())))
        sys.stdout.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
