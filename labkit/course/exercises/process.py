"""Start the process where a student's exercise code runs: sandboxed for `labkit grade`, plain for `labkit check`.

`launch(module, work, ...)` runs `python -m <module> SCRATCH MEMORY <extra>` inside the grading sandbox
(labkit.course.grading.isolation: read-only file system, private scratch, no network, own PID namespace)
when an isolation is given; whatever the process prints goes to a pipe an `OutputTap` counts (past the cap
the caller kills the tree). Used by the judge (labkit.course.exercises.judge).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class OutputTap:
    """Counts the bytes a process prints and keeps the last few thousand."""

    cap: int
    bytes: int = 0
    tail: bytes = b""
    over: bool = False
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start(self, pipe) -> "OutputTap":
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()
        return self

    def _read(self, pipe) -> None:
        while True:
            chunk = pipe.read(65536)
            if not chunk:
                break
            self.bytes += len(chunk)
            self.tail = (self.tail + chunk)[-4000:]
            if self.bytes > self.cap:
                self.over = True
        pipe.close()

    def join(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def last_lines(self, n: int = 3, chars: int = 300) -> str:
        lines = self.tail.decode(errors="replace").strip().splitlines()[-n:]
        return " | ".join(lines)[-chars:]


@dataclass
class Launched:
    proc: subprocess.Popen
    output: OutputTap
    box: object
    """Its labkit.course.grading.confine.Box: the caps of everything it starts; `box.close()` when done."""


def launch(module: str, work: Path, *, extra: list[str], pass_fds: tuple[int, ...], memory_bytes: int,
           output_bytes: int, isolation=None, private: tuple = (), kernel: str = "labkit",
           scratch_bytes: int = 512 * 2**20, stdin=subprocess.DEVNULL) -> Launched:
    """Start `python -m module SCRATCH MEMORY *extra` in `work` (see the module docstring). Sandboxed, its
    whole tree shares one memory and tasks budget (labkit.course.grading.confine); always, it dies with the
    thread that started it (parent-death signal)."""
    from labkit.course.grading import confine
    from labkit.course.grading import isolation as iso_mod
    from labkit.course.grading.sandbox import scratch_env

    work = work.resolve()
    if isolation is None:
        scratch = work / "scratch"
        scratch.mkdir(exist_ok=True)
    else:  # at level unprivileged-user a directory of the student's user elsewhere, removed with the box
        scratch = iso_mod.scratch_dir(isolation, work)
    box = confine.detect().box(memory_bytes) if isolation is not None else confine.unconfined(memory_bytes)
    if isolation is not None and isolation.level == iso_mod.UNPRIVILEGED:
        box.on_close(lambda: iso_mod.release_scratch(isolation, scratch))
    tasks = ["--tasks", str(box.child_tasks())] if box.child_tasks() else []
    argv = [sys.executable, "-m", module, str(scratch), str(memory_bytes), *tasks, *extra]
    if isolation is None:
        cmd, env = argv, {**os.environ, "PYTHONPATH": iso_mod.labkit_path()}
    else:
        view = iso_mod.View(scratch, scratch_bytes, private=tuple(private), shown=iso_mod.runtime_paths(kernel))
        try:
            cmd, env = iso_mod.command(isolation, view, argv, box.tasks), scratch_env(scratch, kernel)
        except BaseException:
            box.close()
            raise
        env["MPLBACKEND"] = "Agg"
    cwd = scratch if isolation is not None and isolation.level == iso_mod.UNPRIVILEGED else work
    proc = subprocess.Popen(box.command(cmd), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            pass_fds=pass_fds, start_new_session=True, env=env, cwd=cwd)
    box.watch(proc)
    return Launched(proc, OutputTap(output_bytes).start(proc.stdout), box)


def child_args(argv: list[str], prog: str, fd_option: str):
    """In the started process: parse `SCRATCH MEMORY --<fd_option> N`, keep the descriptor from its children,
    make the scratch's homes and caches, move there and cap the memory (RLIMIT_AS, inherited by ranks) and,
    when the grader polls instead of using cgroups, the tasks (RLIMIT_NPROC)."""
    import argparse

    from labkit.course.grading.sandbox import _apply_limits

    parser = argparse.ArgumentParser(prog=f"python -m {prog}")
    parser.add_argument("scratch", type=Path)
    parser.add_argument("memory", type=int)
    parser.add_argument("--tasks", type=int, default=0)
    parser.add_argument(fd_option, type=int, required=True, dest="fd")
    parser.add_argument("--warm", metavar="MODULES", default=None,
                        help="import torch and start the ranks' forkserver first, with these comma-separated imports")
    args = parser.parse_args(argv)
    os.set_inheritable(args.fd, False)
    for name in ("home", "tmp", "cache", "config", "mpl", "ipython", "runtime"):
        (args.scratch / name).mkdir(parents=True, exist_ok=True)
    os.chdir(args.scratch)
    _apply_limits(args.memory, 2**30, args.tasks)
    return args


def exit_reason(proc: subprocess.Popen) -> str:
    code = proc.returncode
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
