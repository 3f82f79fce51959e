"""What a process forked from a zygote (a process that imported torch once and forks on request) does to be
exactly what a fresh `python -m MODULE` would have been, and how it ends. Used by the warm notebook kernels
(warmstart.warm_kernels) and the warm torchrun and ranks (warmstart.rank_zygote) of the test suite.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Callable, NoReturn

from labkit.runtime.rank_guard import PARENT_ENV as TORCHRUN_PID_ENV  # torchrun's pid, for its ranks' checks
from labkit.runtime.rank_guard import set_parent_death_signal


def tie_to_parent() -> None:
    """Die with the parent (its death signal); exit now if it died before the signal was set."""
    parent = os.getppid()
    set_parent_death_signal()
    if os.getppid() != parent:
        os._exit(1)


def become_fresh(env: dict[str, str], cwd: str, close: list[int]) -> None:
    """In a child just forked from a zygote: its own session, the zygote's death its own, none of the zygote's
    descriptors in `close`, the environment, working directory and import path a fresh `python -m` started
    in `cwd` with `env` gets, numpy's global random state reseeded, Ctrl-C as Python's default."""
    os.setsid()
    tie_to_parent()  # the zygote's death is this process's
    for fd in close:
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[0] = cwd  # `python -m` puts the working directory first
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a fresh interpreter's entropy, not the zygote's state
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the zygote ignores it


def run_module(argv: list[str], *, quiet: bool = False) -> None:
    """What `python -m MODULE ARGS` does: MODULE (argv[0]) as `__main__`, sys.argv[1:] = ARGS; `quiet`: with
    third-party import noise filtered first, as labkit.runtime.rank_guard runs a rank."""
    if quiet:
        from labkit.runtime.rank_guard import run_module as run_rank_module

        return run_rank_module(argv)
    import runpy

    sys.argv = [argv[0], *argv[1:]]
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


def run_then_exit(main: Callable[[], None]) -> NoReturn:
    """Run `main` and end this process as the interpreter would: SystemExit's code, 1 and a traceback on stderr
    for an uncaught exception, atexit handlers run, stdio flushed (never returns to the zygote's loop)."""
    code = 1
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - what an uncaught exception does to `python -m`: traceback, exit 1
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
