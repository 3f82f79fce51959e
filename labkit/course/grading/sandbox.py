"""Re-execute one submission with papermill in a sandboxed subprocess (`labkit grade --execute`).

Limits, and how each is enforced:
- time: papermill's per-cell `execution_timeout`, plus a hard wall-clock kill of the whole process tree
  at `timeout_s + GRACE_S` (a notebook of many slow cells, a hung kernel start);
- memory: RLIMIT_AS set in the executor before papermill starts, inherited by the kernel and anything it
  spawns (an allocation past the cap raises MemoryError in the student's cell), and the same cap on the whole
  tree together, tasks too (labkit.course.grading.confine: a cgroup, else polling): forked children share it;
- files: only the system, the Python environment and the labkit package, read-only, and a size-capped scratch
  tmpfs; nothing else is there (labkit.course.grading.isolation); RLIMIT_FSIZE, RLIMIT_CORE 0. Where no namespace
  can be made (level unprivileged-user) the sandbox runs as another user instead, and file permissions keep
  the grader's files from it (labkit.course.grading.unprivileged says what that level does not cut);
- output: the executed notebook's size is polled while it runs (in the executor) and the report's size
  (in the grader), and checked before it is ever read;
- network and processes: new network and PID namespaces, so killing the executor kills every process the
  notebook started; the parent-death signal, so a killed grader leaves none behind.
The executor reads the submission on stdin and writes one report (a JSON line, then the executed notebook)
to an inherited file descriptor: nothing the grader reads back lies in a directory the notebook can write.
Run `labkit grade --execute` as an unprivileged user where possible: root can raise its own limits.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from labkit.errors import ConfigError
from labkit.course.grading import confine
from labkit.course.grading import isolation as iso_mod
from labkit.course.grading.confine import kill_process_tree
from labkit.course.grading.isolation import Isolation, View
from labkit.runtime import hooks

OK, CELL_ERROR, KERNEL_DIED, TIMEOUT, OUTPUT_CAP, FAILED = (
    "ok", "cell_error", "kernel_died", "timeout", "output_cap", "failed")
#: Seconds past the per-notebook timeout before the process tree is killed (kernel start, final save).
GRACE_S = 10.0
_POLL_S = 0.25
#: Environment variables an executed notebook inherits from the grader (nothing else: no tokens, no paths
#: into the grader's home).
_ENV_KEEP = ("PATH", "LANG", "LANGUAGE", "TZ", "PYTHONPATH", "VIRTUAL_ENV", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
             "TORCH_EXTENSIONS_DIR", "CUDA_VISIBLE_DEVICES", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_ENV_PREFIXES = ("LC_", "LABKIT_")
#: Set in an executed notebook: its `ex.check` cells then leave the code tests to the grader, which runs them
#: on the submitted cells in its own process (a notebook's own tests/ folder is not in the sandbox).
GRADED_RUN_ENV = "LABKIT_GRADED_RUN"


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed notebook execution."""

    timeout_s: float = 600.0
    """Wall-clock seconds for the whole notebook (also papermill's per-cell timeout)."""
    memory_bytes: int = 8 * 2**30
    """Address-space cap per process (RLIMIT_AS); `import torch` alone maps ~4 GiB of it."""
    output_bytes: int = 50 * 2**20
    """Largest executed notebook accepted (outputs included)."""
    file_bytes: int = 2**30
    """Largest file any sandboxed process may write (RLIMIT_FSIZE)."""
    scratch_bytes: int = 512 * 2**20
    """Size of the private scratch tmpfs (the only writable place; memory, not disk) and of /dev/shm."""
    network: bool = False
    """Allow network access (off: a new network namespace where the OS allows it)."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_bytes", "output_bytes", "file_bytes", "scratch_bytes"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"sandbox limit {name}={getattr(self, name)!r}; it must be > 0")


@dataclass(frozen=True)
class Execution:
    """What happened when a notebook was executed. `output` is the executed notebook, if any is safe to read."""

    outcome: str
    detail: str
    output: Path | None
    isolation: Isolation
    info: dict[str, Any] = field(default_factory=dict)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _watch(proc: subprocess.Popen, report: Path, limits: Limits) -> str | None:
    """Wait for the executor; kill it on the wall-clock limit or when its report passes the output cap."""
    deadline = time.monotonic() + limits.timeout_s + GRACE_S
    while True:
        try:
            proc.wait(timeout=_POLL_S)
            return None
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > deadline or _size(report) > limits.output_bytes + 2**16:
            kill_process_tree(proc.pid)
            proc.wait()
            return TIMEOUT if time.monotonic() > deadline else OUTPUT_CAP


def _cap_detail(output_bytes: int) -> str:
    return f"the executed notebook grew past the {output_bytes / 2**20:.0f} MiB output cap; print less"


def _tail(path: Path, n: int = 600) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(max(_size(path) - n, 0))
            return fh.read().decode(errors="replace").strip()
    except OSError:
        return ""


def _read_report(path: Path, dst: Path, limits: Limits) -> dict[str, Any] | None:
    """The executor's result; its executed notebook (if any) is written to `dst`."""
    if not 0 < _size(path) <= limits.output_bytes + 2**16:
        return None
    head, _, notebook = path.read_bytes().partition(b"\n")
    try:
        result = json.loads(head)
    except ValueError:
        return None
    if notebook:
        dst.write_bytes(notebook)
    return result if isinstance(result, dict) else None


def scratch_env(scratch: Path, kernel: str = "labkit") -> dict[str, str]:
    """The executed notebook's environment: the grader's kept variables, every home and cache in scratch."""
    env = {k: v for k, v in os.environ.items() if k in _ENV_KEEP or k.startswith(_ENV_PREFIXES)}
    # A submission's ranks and kernel start in the sandbox, never forked by a process outside it (the test
    # suite's hook, labkit.runtime.hooks).
    env.pop(hooks.ENV, None)
    dirs = {"HOME": "home", "TMPDIR": "tmp", "JUPYTER_RUNTIME_DIR": "runtime", "IPYTHONDIR": "ipython",
            "MPLCONFIGDIR": "mpl", "XDG_CACHE_HOME": "cache", "XDG_CONFIG_HOME": "config"}
    env.update({k: str(scratch / d) for k, d in dirs.items()})
    env["PYTHONPATH"] = iso_mod.labkit_path()  # executor and kernel import the grader's labkit
    spec = iso_mod.kernel_spec_dir(kernel)
    # Figures render as in Jupyter (a `figure_present` check must see them), whatever the grader's MPLBACKEND.
    env.update({"PYDEVD_DISABLE_FILE_VALIDATION": "1", "MPLBACKEND": "module://matplotlib_inline.backend_inline",
                "PYTHONDONTWRITEBYTECODE": "1"})
    if spec is not None:  # the kernel spec may live in the (hidden, replaced) home: name its data dir
        env["JUPYTER_PATH"] = str(spec.parents[1])
    return env


def execute(src: str | os.PathLike, dst: str | os.PathLike, *, workdir: str | os.PathLike,
            kernel: str = "labkit", parameters: dict[str, Any] | None = None, limits: Limits = Limits(),
            private: tuple[Path, ...] = (), isolation: Isolation | None = None) -> Execution:
    """Run `src` into `dst` under `limits`, `private` paths hidden; never raises for anything the notebook does."""
    src, dst, workdir = Path(src).resolve(), Path(dst).resolve(), Path(workdir).resolve()
    iso = isolation or iso_mod.detect(limits.network)
    dst.parent.mkdir(parents=True, exist_ok=True)
    # Under bubblewrap a fresh tmpfs covers `workdir`, hiding the report and log kept there; at level
    # unprivileged-user the scratch is the student's user's own directory elsewhere (isolation.scratch_dir).
    scratch = iso_mod.scratch_dir(iso, workdir)
    view = View(scratch, limits.scratch_bytes, private=tuple(private) + (src.parent,),
                shown=iso_mod.runtime_paths(kernel), network=limits.network)
    report_path, log_path = workdir / "report", workdir / "executor.log"
    box = confine.detect().box(limits.memory_bytes)
    argv = [sys.executable, "-m", "labkit.course.grading.sandbox", str(scratch), "--kernel", kernel,
            "--timeout", str(limits.timeout_s), "--memory", str(limits.memory_bytes), "--tasks", str(box.child_tasks()),
            "--file-bytes", str(limits.file_bytes), "--output-bytes", str(limits.output_bytes),
            "--scratch-bytes", str(limits.scratch_bytes), "--parameters", json.dumps(parameters or {})]
    try:
        with log_path.open("wb") as log, report_path.open("wb") as report, src.open("rb") as stdin:
            argv += ["--report-fd", str(report.fileno())]
            cmd = box.command(iso_mod.command(iso, view, argv, box.tasks))
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=stdin, pass_fds=(report.fileno(),),
                                    start_new_session=True, env={**scratch_env(scratch, kernel), GRADED_RUN_ENV: "1"},
                                    cwd=scratch if iso.level == iso_mod.UNPRIVILEGED else workdir)
            box.watch(proc)
            killed = _watch(proc, report_path, limits)
        capped = box.exceeded()
    finally:
        box.close()
        iso_mod.release_scratch(iso, scratch)
    run = _outcome(killed, proc, report_path, log_path, dst, limits, iso)
    if capped and run.outcome != OK:
        return replace(run, detail=f"{run.detail} ({capped})" if run.detail else capped, info={**run.info, "capped": capped})
    return run


def _outcome(killed: str | None, proc: subprocess.Popen, report_path: Path, log_path: Path, dst: Path, limits: Limits,
             iso: Isolation) -> Execution:
    if killed == OUTPUT_CAP:
        return Execution(OUTPUT_CAP, _cap_detail(limits.output_bytes), None, iso)
    size = _size(report_path)
    if killed is None and size > limits.output_bytes + 2**16:
        return Execution(OUTPUT_CAP, f"its report is {size / 2**20:.1f} MiB, above the {limits.output_bytes / 2**20:g} "
                         "MiB output cap; refused unread", None, iso)
    result = _read_report(report_path, dst, limits) if killed is None else None
    output = dst if dst.exists() else None
    if killed == TIMEOUT:
        return Execution(TIMEOUT, f"still running after {limits.timeout_s:g} s (+{GRACE_S:g} s grace); killed",
                         output, iso)
    if result is None and proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return Execution(FAILED, "the sandboxed executor was killed (SIGKILL) before it reported (by a process "
                         "the notebook started, or by the Linux OOM killer)", output, iso)
    if result is None:
        return Execution(FAILED, f"the sandboxed executor died before reporting (exit code {proc.returncode}): "
                         f"{_tail(log_path)[-300:] or 'no output'}", output, iso)
    return Execution(str(result.get("outcome", FAILED)), str(result.get("detail", ""))[:500], output, iso, result)


# ---------------------------------------------------------------- the executor (inside the sandbox)
def _apply_limits(memory_bytes: int, file_bytes: int, tasks: int = 0) -> None:
    """Per-process caps, inherited by everything this process starts; `tasks` (polled confinement only) caps the
    processes and threads of the whole sandbox, where it has a user namespace of its own to count them in."""
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    confine.cap_tasks(tasks)
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _bounded_heartbeat_stop() -> None:
    """jupyter_client (8.10) stops its heartbeat channel by joining the thread with no timeout. When the kernel
    died in the middle of a ping (a notebook that wrote into its own sockets and exited) that thread awaits a
    reply no peer will send, so nbclient's cleanup after DeadKernelError -- and this executor -- hung until the
    hard timeout: 10 minutes, reported as 'timeout' where the kernel had died. The thread is a daemon: wait a
    few heartbeats for it, then leave it to the process's exit (`os._exit` below: no atexit waits on it)."""
    from jupyter_client.channels import HBChannel

    def stop(self) -> None:
        self._running = False
        self._exit.set()
        self.join(timeout=5 * self.time_to_dead)
        if not self.is_alive():
            self.close()

    HBChannel.stop = stop


def _run(args: argparse.Namespace, src: Path, dst: Path) -> dict[str, Any]:
    import papermill as pm
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from papermill.exceptions import PapermillExecutionError

    from labkit.course.kernel_client import KernelManager  # its client cannot sleep through a reply

    _bounded_heartbeat_stop()
    try:
        pm.execute_notebook(str(src), str(dst), parameters=json.loads(args.parameters),
                            kernel_name=args.kernel, progress_bar=False, cwd=str(args.scratch / "cwd"),
                            execution_timeout=max(int(args.timeout), 1), start_timeout=60,
                            kernel_manager_class=KernelManager)
        return {"outcome": OK, "detail": "ran to the end"}
    except PapermillExecutionError as exc:
        return {"outcome": CELL_ERROR, "cell": exc.cell_index, "ename": exc.ename,
                "evalue": str(exc.evalue)[:300], "detail": f"cell {exc.cell_index + 1} raised {exc.ename}: "
                f"{str(exc.evalue)[:200]}"}
    except DeadKernelError as exc:
        return {"outcome": KERNEL_DIED, "detail": f"the kernel died ({str(exc)[:200]})"}
    except (CellTimeoutError, TimeoutError) as exc:
        return {"outcome": TIMEOUT, "detail": f"a cell ran past {args.timeout} s ({str(exc)[:150]})"}
    except MemoryError:
        return {"outcome": FAILED, "detail": "the executor ran out of memory (outputs too large?)"}
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        return {"outcome": FAILED, "detail": f"the scratch space is full ({args.scratch_bytes / 2**20:g} MiB "
                "cap): the notebook wrote too much, so its executed copy could not be saved"}


_REPORTED = threading.Lock()  # held by whichever reports first: the run or its guard


def _report(args: argparse.Namespace, result: dict[str, Any], dst: Path) -> None:
    """Write the one report: a JSON line, then the executed notebook when it is within the output cap."""
    if not _REPORTED.acquire(blocking=False):
        return
    if _size(dst) > args.output_bytes:
        result = {"outcome": OUTPUT_CAP, "detail": _cap_detail(args.output_bytes)}
    notebook = dst.read_bytes() if result["outcome"] != OUTPUT_CAP and dst.exists() else b""
    with os.fdopen(args.report_fd, "wb", closefd=False) as out:
        out.write(json.dumps(result).encode() + b"\n" + notebook)


def _guard(dst: Path, args: argparse.Namespace) -> None:
    """Stop everything at the output cap or past the deadline, reporting what ran so far: the grader cannot
    see the scratch tmpfs, so a notebook lost to its hard kill (at timeout + GRACE_S) would lose every cell."""
    deadline = time.monotonic() + args.timeout + GRACE_S / 2
    while _size(dst) <= args.output_bytes and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    _report(args, {"outcome": TIMEOUT, "detail": f"still running after {args.timeout:g} s"}, dst)
    kill_process_tree(os.getpid())  # the kernel and its children (killpg may end this process too: reported already)
    os._exit(0)


def _private_extensions(scratch: Path) -> None:
    """DeepSpeed JIT-loads its C++ ops from TORCH_EXTENSIONS_DIR and takes a lock file there even when they are
    built, so each execution gets a private copy (~20 MB): the original is read-only in the sandbox, and a
    shared writable cache would let one notebook plant code in the next one's ops."""
    src = os.environ.get("TORCH_EXTENSIONS_DIR")
    if src and Path(src).is_dir():
        dst = scratch / "torch_extensions"
        shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock"))
        os.environ["TORCH_EXTENSIONS_DIR"] = str(dst)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.course.grading.sandbox")
    parser.add_argument("scratch", type=Path)
    parser.add_argument("--report-fd", type=int, required=True)
    parser.add_argument("--kernel", default="labkit")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--memory", type=int, default=Limits.memory_bytes)
    parser.add_argument("--tasks", type=int, default=0)
    parser.add_argument("--file-bytes", type=int, default=Limits.file_bytes)
    parser.add_argument("--output-bytes", type=int, default=Limits.output_bytes)
    parser.add_argument("--scratch-bytes", type=int, default=Limits.scratch_bytes)
    parser.add_argument("--parameters", default="{}")
    args = parser.parse_args(argv)
    os.set_inheritable(args.report_fd, False)  # the kernel gets no handle on the report
    _apply_limits(args.memory, args.file_bytes, args.tasks)
    for name in ("cwd", "home", "tmp", "runtime", "ipython", "mpl", "cache", "config"):
        (args.scratch / name).mkdir(parents=True, exist_ok=True)
    src, dst = args.scratch / "submission.ipynb", args.scratch / "executed.ipynb"
    src.write_bytes(sys.stdin.buffer.read())
    _private_extensions(args.scratch)
    threading.Thread(target=_guard, args=(dst, args), daemon=True).start()
    try:
        result = _run(args, src, dst)
    except BaseException as exc:  # noqa: BLE001 - report whatever stopped papermill
        result = {"outcome": FAILED, "detail": f"papermill failed: {type(exc).__name__}: {str(exc)[:300]}"}
    _report(args, result, dst)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # reported already; a heartbeat thread left behind (see _bounded_heartbeat_stop) must not hold the exit
