"""Warm ranks: the runs of one notebook share one torchrun job instead of starting one each.

A cold `labkit.runtime.launch.run` starts torchrun and N fresh ranks for every `run()`; each rank pays Python,
`import torch` (and transformers, DeepSpeed...) and the process-group set-up before its first step:
~10 s per run on a GPU node, and most of a smoke run's wall time on a laptop. `rank_pool.run` sends the
run to ranks that stay up between runs instead (`python -m labkit.train.worker --serve JOBS`, which
reads job-1.json, job-2.json, ... from JOBS and answers each with one done-<n>-<rank> file per rank).

It keeps every promise of a cold launch (labkit.runtime.launch, labkit.runtime.rank_guard):
- a run that fails on any rank ends the whole pool (torchrun stops the other ranks) and is reported as
  a cold run is, naming the rank and its traceback; the next run starts a fresh pool;
- a timeout, or Ctrl-C / Jupyter's interrupt button, kills the pool's whole process tree;
- the caller's death takes torchrun and every rank with it (rank_guard's parent-death links), and so do
  this interpreter's exit (atexit) and `POOL_IDLE_S` seconds without a run (a reaper thread): idle
  ranks hold host memory and, on GPUs, a CUDA context per device;
- nothing of one run reaches the next: after each run a rank destroys the process subgroups it made,
  restores os.environ and torch's global flags, collects garbage and empties the device cache
  (`labkit.train.worker.one_job`); every run seeds itself (labkit.train.loop);
- a run whose rank count, environment (DS_ACCELERATOR=cpu for DeepSpeed on CPU, ...), threads or
  process group (backend, device, timeout: `group`) differ from the pool's gets a new pool.
When: inside a Jupyter kernel by default; LABKIT_WARM_RANKS=0 turns it off, =1 on anywhere. Never for
several nodes, an explicit `log_dir` (a cold run's own folder), or a call from a thread other than the
main one (Linux ties the parent-death signal to the forking *thread*). Introduced in notebook 03_ddp.
"""
from __future__ import annotations

import atexit
import glob
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from labkit.runtime import launch, rank_guard, rank_logs
from labkit.errors import LaunchError

#: The module the warm ranks run (it implements `--serve JOBS`).
SERVER = "labkit.train.worker"
#: Seconds an idle pool lives before the reaper stops it.
POOL_IDLE_S = 600.0
ENV_SWITCH = "LABKIT_WARM_RANKS"
_POLL_S = 0.05
_DONE = "done"


@dataclass(frozen=True)
class PoolKey:
    """What a pool's ranks were started with; a run with another key needs another pool."""

    server: str
    nproc: int
    env: tuple[tuple[str, str], ...]
    threads: int | None
    group: str


def enabled() -> bool:
    """Warm ranks for this process? LABKIT_WARM_RANKS=1/0, else only inside a Jupyter (IPython) kernel."""
    switch = os.environ.get(ENV_SWITCH, "").strip()
    if switch in ("0", "1"):
        return switch == "1"
    ipython = sys.modules.get("IPython")  # a kernel's shell has a .kernel; a plain InteractiveShell has none
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


class _Pool:
    """One torchrun job of `key.nproc` serving ranks, and the files it is driven through."""

    def __init__(self, key: PoolKey):
        self.key, self.root = key, Path(tempfile.mkdtemp(prefix="labkit-warm-"))
        self.jobs, self.logs = self.root / "jobs", self.root / "logs"
        self.jobs.mkdir()
        self.run_id, self.sent, self.busy, self.last_used = f"labkit-warm-{uuid.uuid4().hex[:12]}", 0, False, time.monotonic()
        cmd = launch.torchrun_command(key.server, ["--serve", str(self.jobs)], nproc=key.nproc, log_dir=str(self.logs),
                                      run_id=self.run_id)
        # As in launch.run: own session, parent-death guard; forked from the main thread (see `run`).
        env = launch._child_env(dict(key.env), key.threads)
        self.proc = subprocess.Popen(rank_guard.guarded(cmd, env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.reader = rank_logs._Reader(self.proc.stdout)
        self.reader.start()

    @property
    def pattern(self) -> str:
        return os.path.join(glob.escape(str(self.logs)), f"{self.run_id}_*", "attempt_*", "0")

    def offsets(self) -> dict[str, int]:
        """Bytes rank 0 has written so far to each stream: where this run's output starts."""
        found = glob.glob(self.pattern)
        folder = Path(found[0]) if found else None
        return {name: (folder / f"{name}.log").stat().st_size if folder and (folder / f"{name}.log").exists() else 0
                for name in ("stdout", "stderr")}

    def submit(self, module: str, args: list[str]) -> int:
        self.sent += 1
        tmp = self.jobs / f".job-{self.sent}.json"
        tmp.write_text(json.dumps({"module": module, "argv": [str(a) for a in args]}))
        tmp.replace(self.jobs / f"job-{self.sent}.json")  # atomic: a rank never reads half a job
        return self.sent

    def finished(self, n: int) -> bool:
        return all((self.jobs / f"done-{n}-{rank}").exists() for rank in range(self.key.nproc))

    def wait(self, n: int, timeout_s: float):
        """_DONE, torchrun's exit code (a rank failed: the pool is over), or None when `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.finished(n):
                return _DONE
            code = self.proc.poll()
            if code is not None:
                return _DONE if self.finished(n) else code
            if time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_S)

    def close(self, grace_s: float = launch.KILL_GRACE_S) -> None:
        launch.kill_tree(self.proc, grace_s=grace_s)
        self.reader.join(timeout=grace_s)
        self.proc.stdout.close()


_LOCK = threading.RLock()
_POOL: _Pool | None = None
_REAPER: threading.Thread | None = None


def close_pool(grace_s: float = launch.INTERRUPT_GRACE_S) -> None:
    """Stop the warm ranks now (they start again with the next run). Also runs at interpreter exit."""
    global _POOL
    with _LOCK:
        pool, _POOL = _POOL, None
        if pool is not None:
            pool.close(grace_s)


def current_pids() -> list[int]:
    """torchrun's pid and its ranks' of the live pool (empty without one): for tests and `labkit env`."""
    with _LOCK:
        if _POOL is None or _POOL.proc.poll() is not None:
            return []
        from labkit.runtime import hooks

        head, rest = hooks.process_tree(_POOL.proc.pid)  # the test suite's forked stand-ins too
        return [p.pid for p in head + rest]


def _reap() -> None:
    while True:
        time.sleep(5.0)
        if _LOCK.acquire(blocking=False):
            try:
                if _POOL is not None and not _POOL.busy and (
                        time.monotonic() - _POOL.last_used > POOL_IDLE_S or _POOL.proc.poll() is not None):
                    close_pool()
            finally:
                _LOCK.release()


def _acquire(key: PoolKey) -> _Pool:
    global _POOL, _REAPER
    if _POOL is not None and (_POOL.key != key or _POOL.proc.poll() is not None):
        close_pool()
    if _POOL is None:
        _POOL = _Pool(key)
        if _REAPER is None:
            _REAPER = threading.Thread(target=_reap, name="labkit-warm-reaper", daemon=True)
            _REAPER.start()
    return _POOL


def run(module: str, args: list[str], *, nproc: int, timeout_s: float = 600, env: dict | None = None,
        stream: bool = True, threads: int | None = None, group: str = "", nnodes: int = 1,
        log_dir: str | None = None, **cold) -> launch.LaunchResult:
    """`labkit.runtime.launch.run` on warm ranks when possible (module doc), else a cold launch.

    `module` must offer `parse_job(argv) -> (Profile, fn(ctx))` (labkit.train.worker, labkit.train.many).
    `group` names the process group the runs need (e.g. "gloo/cpu/1800"): pools differ when it does."""
    if (nnodes != 1 or log_dir is not None or cold.get("rdzv_endpoint") or not enabled()
            or threading.current_thread() is not threading.main_thread()):
        return launch.run(module, args, nproc=nproc, timeout_s=timeout_s, env=env, stream=stream, threads=threads,
                          nnodes=nnodes, log_dir=log_dir, **cold)
    launch._check_args(module, nproc, 1, 0, None, timeout_s)
    key = PoolKey(SERVER, nproc, tuple(sorted((k, str(v)) for k, v in (env or {}).items())), threads, group)
    with _LOCK:
        pool = _acquire(key)
        pool.busy = True
        try:
            return _run_job(pool, module, list(args), timeout_s, stream)
        finally:
            pool.busy, pool.last_used = False, time.monotonic()


def _run_job(pool: _Pool, module: str, args: list[str], timeout_s: float, stream: bool) -> launch.LaunchResult:
    tail = rank_logs._RankTail(pool.pattern, echo=stream, offsets=pool.offsets())
    n = pool.submit(module, args)
    tail.start()
    join_s = 10.0
    try:
        outcome = pool.wait(n, timeout_s)
        if outcome is None:
            close_pool(launch.KILL_GRACE_S)
    except BaseException:  # KeyboardInterrupt in a notebook: no rank left behind, control back fast
        join_s = 1.0
        close_pool(launch.INTERRUPT_GRACE_S)
        raise
    finally:
        tail.done.set()
        tail.join(timeout=join_s)
    attempt = rank_logs._attempt_dir(str(pool.logs), pool.run_id)
    if outcome is None:
        raise rank_logs.timeout_error(module, timeout_s, pool.key.nproc, attempt or str(pool.logs), tail.text)
    if outcome != _DONE:  # torchrun ended: a rank failed, and the pool with it
        pool.reader.join(timeout=join_s)
        close_pool()
        raise rank_logs._failure(module, outcome, attempt, pool.reader.text, tail.text, nproc=pool.key.nproc,
                                 node_rank=0)
    return launch.LaunchResult(returncode=0, output=tail.text, log_dir=attempt or str(pool.logs))


atexit.register(close_pool)
