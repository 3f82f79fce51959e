"""Tiny 2-rank gloo programs for tests/test_launch.py, run as `python -m _launch_targets MODE`.

MODE: ok (all-reduce, rank 0 prints the sum), raise (rank 1 raises while rank 0 waits in a barrier),
raise_record (the same with the entry point decorated with torchelastic's @record), hang (rank 1
ignores SIGTERM, says so by a file `hanging` in LABKIT_TEST_PID_DIR and sleeps forever while rank 0 waits
in a barrier), noisy (imports torchao, which peft imports and whose import logs deprecations, then warns
as labkit would). With LABKIT_TEST_PID_DIR set,
each rank writes its pid there so a test can check that no rank outlives the launcher.
"""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def main(mode: str) -> None:
    if mode == "noisy":
        import warnings

        import torchao  # noqa: F401  (what peft and transformers pull in; peft itself costs 5 s more per rank)
        warnings.warn("labkit: a warning of our own stays visible", UserWarning)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pid_dir = os.environ.get("LABKIT_TEST_PID_DIR")
    if pid_dir:
        with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as fh:
            fh.write(str(os.getpid()))
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"rank {rank} of {dist.get_world_size()}: sum={total.item():.0f}")
    if mode.startswith("raise") and rank == 1:
        raise ValueError("rank 1 exploded on purpose")
    if mode == "hang" and rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops it: tests the escalation
        hanging(pid_dir)
        time.sleep(3600)
    dist.barrier()  # rank 0 waits here for the peer that raised or hangs
    dist.destroy_process_group()


def hanging(pid_dir: str | None) -> None:
    """Rank 1 of `hang` ignores SIGTERM from now on: a timeout test starts its short clock here."""
    if pid_dir:
        with open(os.path.join(pid_dir, "hanging"), "w") as fh:
            fh.write(str(os.getpid()))


@record
def recorded_main(mode: str) -> None:
    main(mode)


# ---------------------------------------------------------------- jobs for warm ranks (tests/test_launch_warm.py)
def parse_job(argv: list[str]):
    """labkit.runtime.rank_pool's entry-point protocol: (Profile, fn(ctx)). MODE TAG: ok, raise, hang as above
    (printing TAG), leak (changes what a run may change), state (prints what `leak` changed)."""
    from labkit.profiles import get_profile

    mode, tag = argv[0], argv[1] if len(argv) > 1 else ""
    return get_profile("smoke"), lambda ctx: job(mode, tag, ctx)


def job(mode: str, tag: str, ctx) -> None:
    rank, group = ctx.rank, ctx.group
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total, group=group)
    print(f"rank {rank} of {ctx.world_size}: sum={total.item():.0f} {tag} pid={os.getpid()}", flush=True)
    if mode == "leak":
        dist.new_group(ranks=[0, 1])  # a subgroup the run does not destroy
        os.environ["LABKIT_TEST_LEAK"] = "1"
        torch.set_num_threads(2)
        torch.set_float32_matmul_precision("medium")
    elif mode == "state":
        groups = len(dist.distributed_c10d._world.pg_map)
        print(f"groups={groups} leak={os.environ.get('LABKIT_TEST_LEAK')} threads={torch.get_num_threads()} "
              f"matmul={torch.get_float32_matmul_precision()}", flush=True)
    elif mode == "raise" and rank == 1:
        raise ValueError("rank 1 exploded on purpose")
    elif mode == "hang" and rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        hanging(os.environ.get("LABKIT_TEST_PID_DIR"))
        time.sleep(3600)
    dist.barrier(group=group)


if __name__ == "__main__":
    (recorded_main if sys.argv[1] == "raise_record" else main)(sys.argv[1])
