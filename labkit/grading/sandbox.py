"""Re-execute one submission with papermill in a sandboxed subprocess (`labkit grade --execute`).

Limits, and how each is enforced:
- time: papermill's per-cell `execution_timeout`, plus a hard wall-clock kill of the whole process tree
  at `timeout_s + GRACE_S` (a notebook of many slow cells, a hung kernel start);
- memory: RLIMIT_AS set in the executor before papermill starts, inherited by the kernel and anything it
  spawns (an allocation past the cap raises MemoryError in the student's cell);
- files: RLIMIT_FSIZE (a runaway write is stopped), RLIMIT_CORE 0;
- output: the executed notebook's size is polled while it runs and checked before it is ever read;
- network: a new network namespace (`unshare --net`, loopback only, for the kernel's ZMQ sockets) and a
  new PID namespace, so killing the executor kills every process the notebook started. Where `unshare`
  is missing or not permitted, the run proceeds without isolation and the detail says so.
Not isolated: the file system (the kernel runs as the grader's user in a scratch directory) and CPU
count. Run `labkit grade --execute` as an unprivileged user: root can raise its own limits.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.errors import ConfigError

OK, CELL_ERROR, KERNEL_DIED, TIMEOUT, OUTPUT_CAP, FAILED = (
    "ok", "cell_error", "kernel_died", "timeout", "output_cap", "failed")
#: Seconds past the per-notebook timeout before the process tree is killed (kernel start, final save).
GRACE_S = 10.0
_POLL_S = 0.25


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
    network: bool = False
    """Allow network access (off: a new network namespace where the OS allows it)."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_bytes", "output_bytes", "file_bytes"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"sandbox limit {name}={getattr(self, name)!r}; it must be > 0")


@dataclass(frozen=True)
class Execution:
    """What happened when a notebook was executed. `output` is the executed notebook, if any is safe to read."""

    outcome: str
    detail: str
    output: Path | None
    isolation: str
    info: dict[str, Any] = field(default_factory=dict)


@functools.lru_cache(maxsize=1)
def isolation_prefix() -> tuple[tuple[str, ...], str]:
    """(command prefix, description): network+PID namespaces if this machine allows them, else ()."""
    unshare, ip = shutil.which("unshare"), shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin")
    if not unshare or not ip:
        return (), "network NOT isolated (`unshare` or `ip` not found)"
    base = (unshare, "--net", "--pid", "--fork", "--kill-child", "--mount-proc")
    tail = ("sh", "-c", f'{ip} link set lo up && exec "$@"', "sh")
    # Root can create the namespaces directly; anyone else needs a user namespace mapping them to root in it
    # (which also keeps them from raising their resource limits).
    candidates = ([base + tail] if os.geteuid() == 0 else []) + [base + ("--user", "--map-root-user") + tail]
    why = "no message"
    for prefix in candidates:
        try:
            probe = subprocess.run(prefix + ("true",), capture_output=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = str(exc)
            continue
        if probe.returncode == 0:
            return prefix, "no network (new network namespace)"
        why = (probe.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
    return (), f"network NOT isolated (unshare failed: {why[:120]})"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the executor and every descendant (kernels start their own sessions, so killpg alone misses them)."""
    try:
        import psutil
        children = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - the process may already be gone
        children = []
    for p in children:
        try:
            p.kill()
        except Exception:  # noqa: BLE001
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _watch(proc: subprocess.Popen, dst: Path, limits: Limits) -> str | None:
    """Wait for the executor; kill it on the wall-clock limit or when the output passes its cap."""
    deadline = time.monotonic() + limits.timeout_s + GRACE_S
    while True:
        try:
            proc.wait(timeout=_POLL_S)
            return None
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > deadline:
            _kill_tree(proc)
            return TIMEOUT
        if _size(dst) > limits.output_bytes:
            _kill_tree(proc)
            return OUTPUT_CAP


def _tail(path: Path, n: int = 600) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(max(_size(path) - n, 0))
            return fh.read().decode(errors="replace").strip()
    except OSError:
        return ""


def _read_result(path: Path) -> dict[str, Any] | None:
    if not 0 < _size(path) < 2**16:
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def execute(src: str | os.PathLike, dst: str | os.PathLike, *, workdir: str | os.PathLike,
            kernel: str = "labkit", parameters: dict[str, Any] | None = None,
            limits: Limits = Limits()) -> Execution:
    """Run `src` into `dst` under `limits`; never raises for anything the notebook does."""
    src, dst, workdir = Path(src).resolve(), Path(dst).resolve(), Path(workdir).resolve()
    (workdir / "cwd").mkdir(parents=True, exist_ok=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    result_path, log_path = workdir / "result.json", workdir / "executor.log"
    prefix, isolation = ((), "network allowed") if limits.network else isolation_prefix()
    cmd = [*prefix, sys.executable, "-m", "labkit.grading.sandbox", str(src), str(dst), str(result_path),
           "--kernel", kernel, "--timeout", str(limits.timeout_s), "--memory", str(limits.memory_bytes),
           "--file-bytes", str(limits.file_bytes), "--parameters", json.dumps(parameters or {}),
           "--cwd", str(workdir / "cwd")]
    # Figures render as in Jupyter (a `figure_present` check must see them), whatever the grader's MPLBACKEND.
    env = {**os.environ, "PYDEVD_DISABLE_FILE_VALIDATION": "1",
           "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env, cwd=workdir)
        killed = _watch(proc, dst, limits)
    if killed == OUTPUT_CAP or _size(dst) > limits.output_bytes:
        size = _size(dst)
        dst.unlink(missing_ok=True)
        return Execution(OUTPUT_CAP, f"the executed notebook grew past the {limits.output_bytes / 2**20:.0f} MiB "
                         f"output cap ({size / 2**20:.0f} MiB when stopped); print less", None, isolation)
    output = dst if dst.exists() else None
    if killed == TIMEOUT:
        return Execution(TIMEOUT, f"still running after {limits.timeout_s:g} s (+{GRACE_S:g} s grace); killed",
                         output, isolation)
    result = _read_result(result_path)
    if result is None:
        return Execution(FAILED, f"the executor died (exit code {proc.returncode}): "
                         f"{_tail(log_path)[-300:] or 'no output'}", output, isolation)
    return Execution(str(result.get("outcome", FAILED)), str(result.get("detail", ""))[:500], output,
                     isolation, result)


# ---------------------------------------------------------------- the executor (inside the sandbox)
def _apply_limits(memory_bytes: int, file_bytes: int) -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _run(args: argparse.Namespace) -> dict[str, Any]:
    import papermill as pm
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from papermill.exceptions import PapermillExecutionError

    try:
        pm.execute_notebook(args.src, args.dst, parameters=json.loads(args.parameters),
                            kernel_name=args.kernel, progress_bar=False, cwd=args.cwd,
                            execution_timeout=max(int(args.timeout), 1), start_timeout=60)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.grading.sandbox")
    for name in ("src", "dst", "result"):
        parser.add_argument(name)
    parser.add_argument("--kernel", default="labkit")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--memory", type=int, default=Limits.memory_bytes)
    parser.add_argument("--file-bytes", type=int, default=Limits.file_bytes)
    parser.add_argument("--parameters", default="{}")
    parser.add_argument("--cwd", default=None)
    args = parser.parse_args(argv)
    _apply_limits(args.memory, args.file_bytes)
    try:
        result = _run(args)
    except BaseException as exc:  # noqa: BLE001 - report whatever stopped papermill
        result = {"outcome": FAILED, "detail": f"papermill failed: {type(exc).__name__}: {str(exc)[:300]}"}
    Path(args.result).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
