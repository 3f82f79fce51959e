"""Run a Python module on N ranks under torchrun, from a terminal or a notebook cell.

`run("labkit.train", [...], nproc=2)` starts `python -m torch.distributed.run ... -m labkit.train ...`
and gives back rank 0's output (streamed live while it runs, so a notebook cell shows it) or raises
`LaunchError` naming the rank that failed first and carrying its traceback. It never hangs: torchrun
stops the surviving ranks when one fails, and a wall-clock timeout (or Ctrl-C / the notebook's
interrupt button) kills the whole process tree, SIGTERM first and SIGKILL after a grace period
(a short one on interrupt: control is back within seconds). A run that may hang on purpose (a
lesson's skipped collective) gives `hang_timeout_s`: that clock starts once every rank has called
`rank_ready()` (imports and process group done), so a busy machine's slow start-up never eats it.
If the launcher itself dies without cleaning up (SIGKILL, a kernel restart), `labkit.runtime.rank_guard`
takes torchrun and every rank down with it.

Rank logs: torchrun writes one folder per local rank (`--log-dir`, `--redirects 3`); `LaunchResult.log_dir`
is the `attempt_0` folder. `labkit.runtime.rank_logs` follows rank 0's logs live and reads the failing
rank's traceback out of them.
Introduced in notebook 03_ddp.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from labkit.runtime import rank_guard
from labkit.runtime.rank_logs import _attempt_dir, _failure, _RankTail, _Reader, timeout_error
from labkit.errors import ConfigError, LaunchError

#: Seconds between SIGTERM and SIGKILL when a run times out.
KILL_GRACE_S = 5.0
#: ... and when the user interrupts (Ctrl-C, Jupyter's interrupt button): control back fast.
INTERRUPT_GRACE_S = 1.5
#: Ranks start as `python -m RANK_ENTRY MODULE ARGS` (parent-death guard + quiet imports, then MODULE).
RANK_ENTRY = "labkit.runtime.rank_guard"
_POLL_S = 0.1


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Set environment variables (for the kernel papermill starts: it inherits ours; for a rehearsal's
    in-process rank), then restore them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@dataclass(frozen=True)
class LaunchResult:
    """A finished run: torchrun's exit code, rank 0's output (stdout and stderr) and the rank-log folder."""

    returncode: int
    output: str
    log_dir: str


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it; tiny race, as in torchrun)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def torchrun_command(module: str, args: list[str], *, nproc: int, nnodes: int = 1, node_rank: int = 0,
                     rdzv_endpoint: str | None = None, log_dir: str, run_id: str,
                     port: int | None = None) -> list[str]:
    """The torchrun argv for `run` (pure: no process is started)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--nnodes", str(nnodes), "--max-restarts", "0", "--rdzv-id", run_id,
           "--log-dir", log_dir, "--redirects", "3"]
    if nnodes == 1 and rdzv_endpoint is None:
        # Static rendezvous on loopback: no c10d rendezvous round trips for a one-node job.
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port or free_port())]
    else:
        # Static, not c10d: c10d ignores --node-rank and orders nodes by (host, pid), so global rank 0
        # could land on any node; labkit streams and writes results from node 0, so node 0 must hold
        # ranks 0..nproc-1. Node 0 hosts the TCPStore at the endpoint (the head node in the job files).
        cmd += ["--node-rank", str(node_rank), "--rdzv-backend", "static", "--rdzv-endpoint", str(rdzv_endpoint)]
    return cmd + ["-m", RANK_ENTRY, module, *map(str, args)]


def _run_id(module: str, nnodes: int, rdzv_endpoint: str | None) -> str:
    """Rendezvous id (names the log folder): random on one node; on several, equal on every node.

    Only what every node agrees on goes in: the args may differ per node (e.g. a per-node run id).
    """
    if nnodes == 1:
        return f"labkit-{uuid.uuid4().hex[:12]}"
    key = "\0".join([module, str(nnodes), str(rdzv_endpoint)])
    return f"labkit-{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def _check_args(module: str, nproc: int, nnodes: int, node_rank: int, rdzv_endpoint: str | None,
                timeout_s: float) -> None:
    for name, value in (("nproc", nproc), ("nnodes", nnodes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"launch {name}={value!r}; it must be a positive integer")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"launch node_rank={node_rank!r}; it must be in 0..{nnodes - 1} for nnodes={nnodes}")
    if nnodes > 1 and not rdzv_endpoint:
        raise ConfigError(f"launch nnodes={nnodes} needs rdzv_endpoint='<head-node>:29500' "
                          "(the same on every node)")
    if not timeout_s > 0:
        raise ConfigError(f"launch timeout_s={timeout_s!r}; it must be > 0 seconds")
    if not module or module.endswith(".py"):
        raise ConfigError(f"launch module={module!r}; give a module name as for `python -m`, e.g. 'labkit.train'")


#: Strategies whose ranks do real CPU work: CPU Adam of offloaded optimizer states (ZeRO-Offload,
#: FSDP2 CPUOffloadPolicy) or NF4 quantizing of a 4-bit base on load (QLoRA). Issue 14, finding 13.
CPU_HEAVY_STRATEGIES = frozenset({"fsdp-offload", "zero3-offload", "qlora", "fsdp-qlora", "fsdp-qlora-offload"})


def cpu_threads(nproc: int, *, cpu_heavy: bool) -> int:
    """Intra-op threads per rank: 1 (N ranks x all cores oversubscribes the CPU), or cores // nproc
    for ranks doing real CPU work (CPU Adam of ZeRO/FSDP offload, NF4 quantizing of QLoRA)."""
    if not cpu_heavy:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, nproc))


def _child_env(env: dict | None, threads: int | None = None) -> dict[str, str]:
    child = dict(os.environ)
    if threads is not None:
        child["OMP_NUM_THREADS"] = str(threads)
    child.update({k: str(v) for k, v in (env or {}).items()})
    child.setdefault("OMP_NUM_THREADS", "1")  # one intra-op thread per rank unless asked otherwise
    # Ranks write to log files, which Python block-buffers; unbuffered output makes the live view live.
    child.setdefault("PYTHONUNBUFFERED", "1")
    return child


def kill_tree(proc: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM every descendant of torchrun (ranks run in their own sessions), then torchrun, SIGKILL what
    survives. The ranks go first: what a rank does on SIGTERM (a stack dump into its log: the hang demo,
    labkit.profiling.hangdemo) must finish before torchrun's exit trips its parent-death guard
    (labkit.runtime.rank_guard), which SIGKILLs it -- a loaded CI machine cut a dump in half that way."""
    import psutil

    from labkit.runtime import hooks

    head, ranks = hooks.process_tree(proc.pid)  # [torchrun], its descendants (the test suite's forked ones too)
    _signal_groups(ranks, signal.SIGTERM)
    _, ranks_alive = psutil.wait_procs(ranks, timeout=grace_s)
    _signal_groups(head + ranks_alive, signal.SIGTERM)
    _, alive = psutil.wait_procs(head + ranks_alive, timeout=grace_s)
    _signal_groups(alive, signal.SIGKILL)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:  # what started torchrun outlived it (a test hook's shim): it must not stay
        proc.kill()
        proc.wait()


def _signal_groups(procs, sig) -> None:
    """Signal each process group of `procs` (so grandchildren such as data loaders go too)."""
    own = os.getpgrp()
    for p in procs:
        try:
            pgid = os.getpgid(p.pid)
            if pgid != own:
                os.killpg(pgid, sig)
            else:
                os.kill(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """torchrun's exit code, or None when `timeout_s` passed first (the process is left running)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return proc.wait(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                return None


#: A rank's environment names the folder where `rank_ready()` leaves its mark (runs with hang_timeout_s).
READY_ENV = "LABKIT_READY_DIR"


def rank_ready() -> None:
    """Called on a rank once it is set up (imports, process group): a launch with `hang_timeout_s`
    starts that clock when every rank has said so. Does nothing outside such a launch."""
    folder = os.environ.get(READY_ENV)
    if folder:
        Path(folder, os.environ.get("RANK", "0")).touch()


def _wait_ready(proc: subprocess.Popen, timeout_s: float, folder: str, nproc: int, hang_timeout_s: float):
    """`_wait`, but stop `hang_timeout_s` after all `nproc` ranks called `rank_ready()` (never later than
    `timeout_s`): (exit code or None, whether the hang clock ran out)."""
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(folder)) < nproc:
        try:
            return proc.wait(timeout=_POLL_S), False
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                return None, False
    left = deadline - time.monotonic()
    return _wait(proc, min(left, hang_timeout_s)), hang_timeout_s < left


def run(module: str, args: list[str], *, nproc: int, timeout_s: float = 600, env: dict | None = None,
        nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None, log_dir: str | None = None,
        stream: bool = True, threads: int | None = None, hang_timeout_s: float | None = None) -> LaunchResult:
    """Run `python -m module *args` on `nproc` ranks per node under torchrun.

    Streams local rank 0's output live (when `stream` and this is node 0), returns a `LaunchResult`
    on success, raises `LaunchError` (with `.rank`, `.traceback`, `.output`) when a rank fails or the
    run exceeds `timeout_s`; in every case no rank is left running on this node. `threads` sets
    OMP_NUM_THREADS per rank (default: the caller's, else 1; see `cpu_threads`); `env` wins over it.
    `hang_timeout_s`: also stop the run that many seconds after every rank of this node called
    `rank_ready()` (a hang's clock: start-up under load does not count).
    """
    _check_args(module, nproc, nnodes, node_rank, rdzv_endpoint, timeout_s)
    if hang_timeout_s is not None and not hang_timeout_s > 0:
        raise ConfigError(f"hang_timeout_s={hang_timeout_s!r}: give seconds > 0 (or None for no hang clock)")
    root = os.path.abspath(log_dir) if log_dir else tempfile.mkdtemp(prefix="labkit-launch-")
    if nnodes > 1:  # nodes may share a file system and run ids match across nodes: one folder per node
        root = os.path.join(root, f"node{node_rank}")
    os.makedirs(root, exist_ok=True)
    for tries_left in reversed(range(_PORT_TRIES if nnodes == 1 and rdzv_endpoint is None else 1)):
        run_id = _run_id(module, nnodes, rdzv_endpoint)
        cmd = torchrun_command(module, list(args), nproc=nproc, nnodes=nnodes, node_rank=node_rank,
                               rdzv_endpoint=rdzv_endpoint, log_dir=root, run_id=run_id)
        child_env, ready = _child_env(env, threads), None
        if hang_timeout_s is not None:
            ready = (tempfile.mkdtemp(prefix="ready-", dir=root), nproc, hang_timeout_s)
            child_env[READY_ENV] = ready[0]
        code, launcher, output, hung = _launch_once(cmd, os.path.join(glob.escape(root), f"{run_id}_*", "attempt_*", "0"),
                                                    env=child_env, timeout_s=timeout_s,
                                                    echo=stream and node_rank == 0, ready=ready)
        # free_port()'s port was free a moment ago; another job (a second test worker) can bind it before
        # torchrun's store does: then no rank started, and a new port is tried, as spawn() does.
        if not (code and tries_left and _port_taken(launcher)):
            break
    attempt = _attempt_dir(root, run_id)
    if code is None and hung:
        raise LaunchError(f"{module} did not finish within hang_timeout_s={hang_timeout_s:g} s after its {nproc} "
                          f"rank(s) were ready; all ranks were stopped. Look for a rank stuck in a collective "
                          f"in the logs under {attempt or root}", output=output)
    if code is None:
        raise timeout_error(module, timeout_s, nproc, attempt or root, output)
    if code != 0:
        raise _failure(module, code, attempt, launcher, output, nproc=nproc, node_rank=node_rank)
    return LaunchResult(returncode=code, output=output, log_dir=attempt or root)


_PORT_TRIES = 3


def _port_taken(launcher_output: str) -> bool:
    return "eaddrinuse" in launcher_output.lower()


def _launch_once(cmd: list[str], pattern: str, *, env: dict, timeout_s: float, echo: bool,
                 ready: tuple | None = None) -> tuple[int | None, str, str, bool]:
    """Start torchrun, follow rank 0, wait: (exit code or None on timeout, torchrun's output, rank 0's output,
    whether the hang clock of `ready` = (folder, nproc, hang_timeout_s) ran out)."""
    # New session: a terminal's Ctrl-C reaches only us, and we stop the job in order. `guarded`: if
    # we die without doing so, the kernel kills torchrun, and torchrun's ranks follow (rank_guard).
    # This thread forks torchrun and stays in this function until torchrun is gone (see rank_guard).
    proc = subprocess.Popen(rank_guard.guarded(cmd, env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    reader, tail = _Reader(proc.stdout), _RankTail(pattern, echo=echo)
    reader.start()
    tail.start()
    join_s, hung = 10.0, False
    try:
        code, hung = (_wait(proc, timeout_s), False) if ready is None else _wait_ready(proc, timeout_s, *ready)
        if code is None:
            kill_tree(proc)
    except BaseException:  # KeyboardInterrupt in a notebook: never leave ranks behind, and be quick
        join_s = 1.0
        kill_tree(proc, grace_s=INTERRUPT_GRACE_S)
        raise
    finally:
        tail.done.set()
        tail.join(timeout=join_s)
        reader.join(timeout=join_s)
        proc.stdout.close()
    return code, reader.text, tail.text, hung
