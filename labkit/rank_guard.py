"""No orphaned ranks: tie torchrun's life to the launcher's, and every rank's life to torchrun's.

`labkit.launch.run` starts torchrun in its own session (so Ctrl-C in a terminal reaches only the
launcher, which then stops the job in order). The price: if the launcher dies without running its
handlers -- SIGKILL, a Jupyter kernel restart, an ssh drop -- torchrun and its ranks would go on with
ppid 1, holding the GPUs. Two links prevent that:

1. torchrun is started through `guarded(cmd)`: a tiny interpreter sets the Linux parent-death signal
   (`prctl(PR_SET_PDEATHSIG, SIGKILL)`, kept across `execv`) and then becomes torchrun. The kernel
   sends the signal when the *thread* that forked it ends, so `launch.run` forks from the thread
   that then waits in `run` until torchrun is gone (which is how it is written).
2. torchrun starts each rank as `python -m labkit.rank_guard MODULE ARGS...` (see `launch.run`): the
   rank sets the same parent-death signal against torchrun, checks torchrun is still its parent
   (it could have died before the prctl), starts a watchdog thread that kills the rank when its
   parent changes (a second line where prctl is unavailable), quietens third-party import noise
   (`labkit.quiet`), and runs MODULE as `__main__`. (In the test suite it may instead stand in for a
   rank forked from a warm zygote: labkit.rank_zygote.)
Introduced in notebook 03_ddp.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

from labkit import forking

#: Environment variable holding torchrun's pid, set by the guard that becomes torchrun.
PARENT_ENV = forking.TORCHRUN_PID_ENV
_WATCH_S = 0.5
#: Ask Linux to send a signal to this process when its parent (thread) dies (one implementation: labkit.forking).
set_parent_death_signal = forking.set_parent_death_signal

# Runs in a bare interpreter (-I -S: no site, no PYTHONPATH): sets the death signal, checks the
# launcher (argv[1]) is still the parent, records its own pid (torchrun's, after exec) for the ranks.
_EXEC_GUARD = (
    "import os,sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    import ctypes\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, 9)\n"  # PR_SET_PDEATHSIG, SIGKILL
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    f"os.environ[{PARENT_ENV!r}] = str(os.getpid())\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def guarded(cmd: list[str], env: dict[str, str] | None = None) -> list[str]:
    """`cmd` (an absolute executable first) behind the parent-death guard of the calling process. In the
    test suite (`env`, default ours, names a rank zygote) torchrun itself forks warm: labkit.rank_zygote."""
    from labkit import rank_zygote

    return [sys.executable, "-I", "-S", "-c", _EXEC_GUARD, str(os.getpid()), *rank_zygote.warm_command(cmd, env)]


def _die() -> None:
    """Kill this rank and its own process group (data-loader workers), never anything above it."""
    try:
        if os.getpgrp() == os.getpid():  # torchrun starts each rank as a session leader
            os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def watch_parent(parent: int, interval_s: float = _WATCH_S) -> threading.Thread:
    """A daemon thread that kills this process as soon as `parent` is no longer its parent."""
    def loop() -> None:
        while os.getppid() == parent:
            threading.Event().wait(interval_s)
        _die()

    thread = threading.Thread(target=loop, name="labkit-parent-watchdog", daemon=True)
    thread.start()
    return thread


def guard_rank() -> None:
    """Tie this rank to torchrun (pid in $LABKIT_TORCHRUN_PID); no-op when not started by labkit."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    set_parent_death_signal()
    if os.getppid() != int(parent):  # torchrun died before the prctl took effect
        _die()
    watch_parent(int(parent))


def main(argv: list[str]) -> None:
    """`python -m labkit.rank_guard MODULE ARGS...`: guard, quieten, then run MODULE as __main__ -- or, in
    the test suite (labkit.rank_zygote), have a warm zygote fork the rank and stand in for it."""
    if not argv:
        raise SystemExit("usage: python -m labkit.rank_guard MODULE [ARGS...]")
    guard_rank()
    from labkit import rank_zygote

    code = rank_zygote.delegate(argv)
    if code is not None:
        rank_zygote.exit_like(code)
    forking.run_module(argv, quiet=True)


if __name__ == "__main__":
    main(sys.argv[1:])
