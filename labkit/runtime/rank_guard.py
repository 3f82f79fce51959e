"""No orphaned ranks: tie torchrun's life to the launcher's, and every rank's life to torchrun's.

`labkit.runtime.launch.run` starts torchrun in its own session (so Ctrl-C in a terminal reaches only the
launcher, which then stops the job in order). The price: if the launcher dies without running its
handlers -- SIGKILL, a Jupyter kernel restart, an ssh drop -- torchrun and its ranks would go on with
ppid 1, holding the GPUs. Two links prevent that:

1. torchrun is started through `guarded(cmd)`: a tiny interpreter sets the Linux parent-death signal
   (`prctl(PR_SET_PDEATHSIG, SIGKILL)`, kept across `execv`) and then becomes torchrun. The kernel
   sends the signal when the *thread* that forked it ends, so `launch.run` forks from the thread
   that then waits in `run` until torchrun is gone (which is how it is written).
2. torchrun starts each rank as `python -m labkit.runtime.rank_guard MODULE ARGS...` (see `launch.run`): the
   rank sets the same parent-death signal against torchrun, checks torchrun is still its parent
   (it could have died before the prctl), starts a watchdog thread that kills the rank when its
   parent changes (a second line where prctl is unavailable), quietens third-party import noise
   (`labkit.runtime.quiet`), and runs MODULE as `__main__`. (In the test suite it may instead stand in for a
   rank forked from a warm process: labkit.runtime.hooks.)
Introduced in notebook 03_ddp.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

from labkit.runtime import hooks

#: Environment variable holding torchrun's pid, set by the guard that becomes torchrun.
PARENT_ENV = "LABKIT_TORCHRUN_PID"
_WATCH_S = 0.5


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send `sig` to this process when its parent (thread) dies; False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(1, int(sig)) == 0  # PR_SET_PDEATHSIG

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
    """`cmd` (an absolute executable first) behind the parent-death guard of the calling process (in the
    test suite, `env` -- default ours -- may name a hook that starts torchrun another way: labkit.runtime.hooks)."""
    hook = hooks.get("torchrun_command", env)
    return [sys.executable, "-I", "-S", "-c", _EXEC_GUARD, str(os.getpid()), *(hook(cmd, env) if hook else cmd)]


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
    """`python -m labkit.runtime.rank_guard MODULE ARGS...`: guard, quieten, then run MODULE as __main__ -- or,
    in the test suite, let its hook run the rank (labkit.runtime.hooks) and leave with its exit status."""
    if not argv:
        raise SystemExit("usage: python -m labkit.runtime.rank_guard MODULE [ARGS...]")
    guard_rank()
    hook = hooks.get("run_rank")
    if hook is not None:
        hook(argv)  # runs the rank elsewhere and ends this process as it ended, or returns: run it here
    run_module(argv)


def run_module(argv: list[str]) -> None:
    """What `python -m MODULE ARGS` does (MODULE = argv[0] as `__main__`, sys.argv[1:] = ARGS), third-party
    import noise filtered first (labkit.runtime.quiet)."""
    import runpy

    from labkit.runtime import quiet

    quiet.install()
    sys.argv = [argv[0], *argv[1:]]
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
