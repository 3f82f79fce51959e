"""Tiny 2-rank gloo programs for tests/test_launch.py, run as `python -m _launch_targets MODE`.

MODE: ok (all-reduce, rank 0 prints the sum), raise (rank 1 raises while rank 0 waits in a barrier),
raise_record (the same with the entry point decorated with torchelastic's @record), hang (rank 1
ignores SIGTERM and sleeps forever while rank 0 waits in a barrier), noisy (imports peft, whose
torchao import logs deprecations, then warns as labkit would). With LABKIT_TEST_PID_DIR set,
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

        import peft  # noqa: F401  (pulls in torchao)
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
        time.sleep(3600)
    dist.barrier()  # rank 0 waits here for the peer that raised or hangs
    dist.destroy_process_group()


@record
def recorded_main(mode: str) -> None:
    main(mode)


if __name__ == "__main__":
    (recorded_main if sys.argv[1] == "raise_record" else main)(sys.argv[1])
