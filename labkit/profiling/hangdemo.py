"""A deliberate hang, and how to find it: one rank skips a collective (notebook 09_beyond_3d).

Run on ranks as `python -m labkit.profiling.hangdemo --skip-rank 1 --skip-step 2` (through `labkit.runtime.launch.run`
with a short `hang_timeout_s`: counted from when both ranks are up, `launch.rank_ready()`). Every step
all-reduces the loss for logging; the skipping rank "forgets" that all-reduce at one step -- the classic
bug of a collective inside a branch that not all ranks take -- and goes on to the end-of-run barrier. Its peer waits in the all-reduce forever: gloo and
NCCL have no idea the other rank will never come (their own timeouts default to 30-10 minutes).

What finds it on CPU: every rank arms `faulthandler.dump_traceback_later(dump_after_s)`, which prints
all of its threads' Python stacks to its stderr log if the run is still going then, dumps them again
when the launcher stops it (SIGTERM), and registers SIGUSR1 for an on-demand dump (`kill -USR1 <pid>`:
what `py-spy dump --pid <pid>` gives without a handler, when ptrace is allowed). `stuck_frames(log_root)` reads those dumps back: per rank, the
innermost frame of this program's main thread. On GPUs, see docs/beyond_3d.md (NCCL flight recorder,
TORCH_DISTRIBUTED_DEBUG=DETAIL, NCCL_DEBUG=INFO).
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import glob
import os
import re
import signal
import sys
from pathlib import Path

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def train(rank: int, steps: int, skip_rank: int, skip_step: int) -> None:
    import torch
    import torch.distributed as dist

    for step in range(steps):
        loss = torch.tensor([1.0 / (step + 1) + rank])  # stands in for this rank's loss
        if rank == skip_rank and step == skip_step:
            continue  # THE BUG: this rank skips the logging all-reduce below at this step
        log_loss(loss, step, rank)
    dist.barrier()  # end of run: every rank meets here


def log_loss(loss, step: int, rank: int) -> None:
    import torch.distributed as dist

    dist.all_reduce(loss)  # mean loss for the log: every rank must call this, every step
    if rank == 0:
        print(f"step {step}: mean loss {loss.item() / dist.get_world_size():.4f}", flush=True)


def main(argv=None) -> None:
    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="python -m labkit.profiling.hangdemo")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--skip-rank", type=int, default=1, help="rank that skips one all-reduce; -1 = none (fixed)")
    p.add_argument("--skip-step", type=int, default=2)
    p.add_argument("--dump-after", type=float, default=5.0, help="seconds before each rank dumps its stacks")
    a = p.parse_args(argv)
    from labkit.runtime import launch

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: dump now
    # ... and when the launcher stops the hung run (SIGTERM): the stacks are in the log whatever the timing
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    # The collective timeout stays far above the launcher's: the launcher is what stops a hung run.
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank = dist.get_rank()
    print(f"rank {rank} pid {os.getpid()} started", file=sys.stderr, flush=True)
    launch.rank_ready()  # the launcher's hang_timeout_s starts when every rank got here
    faulthandler.dump_traceback_later(a.dump_after, exit=False)  # dump if still running then
    train(rank, a.steps, a.skip_rank, a.skip_step)
    faulthandler.cancel_dump_traceback_later()
    if rank == 0:
        print("all ranks finished", flush=True)
    dist.destroy_process_group()


def stuck_frames(log_root: str | Path) -> dict[int, dict]:
    """Per local rank: the innermost frame of the main thread's last faulthandler dump in its stderr
    log under `log_root` (the launcher's log folder: `<root>/<run id>/attempt_0/<rank>/stderr.log`),
    as {'file', 'line', 'func', 'stack': [func, ...] outermost first, 'caller': innermost non-torch frame}. Ranks without a dump are left out."""
    out = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(str(log_root)), "**", "stderr.log"), recursive=True)):
        rank = int(Path(path).parent.name)
        text = Path(path).read_text(errors="replace")
        dumps = re.split(r"^(?:Timeout \([^)]*\)!\n)?(?:Current thread|Thread) 0x[0-9a-f]+", text, flags=re.M)
        mains = [d for d in dumps[1:] if "(most recent call first)" in d and "in <module>" in d]
        if not mains:
            continue
        frames = [m.groupdict() for m in _FRAME.finditer(mains[-1].split("\n\n")[0])]  # innermost first
        if frames:
            mine = next((f for f in frames if "/torch/" not in f["file"]), frames[0])  # the program's own frame
            out[rank] = {**frames[0], "line": int(frames[0]["line"]), "stack": [f["func"] for f in reversed(frames)],
                         "caller": f"{os.path.basename(mine['file'])}:{mine['line']} in {mine['func']}"}
    return out


if __name__ == "__main__":
    main()
