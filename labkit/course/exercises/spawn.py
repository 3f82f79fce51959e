"""`spawn(fn, world=2, args=(), timeout=...)`: run a student's rank function on `world` fresh processes.

Each process gets a gloo process group already initialised (env rendezvous on a free loopback port,
`OMP_NUM_THREADS=1`) and calls `fn(rank, world, *args)`; `spawn` returns the per-rank return values.
`fn` travels by value (cloudpickle), so a function defined in a notebook cell or a test file works.
With `profile=` the ranks join the way that profile's runs do (`labkit.runtime.device.join_group`): on a GPU
profile rank r computes on cuda:r over NCCL (so a student's function meets the model `library_parts`
put on cuda:r with a group and meshes of the same device), and a world larger than the node's GPUs
is refused before anything starts; a rehearsal records that and runs gloo on CPU.
A rank that raises -> `ExerciseError` naming the rank and the error (the other ranks are killed: they
would wait in a collective forever); a run that outlives `timeout` -> killed, `ExerciseError` says so.
Every rank is its own session leader with the parent-death signal set, and is killed with its group, so
no process survives `spawn`, even when the caller is killed (a kernel restart, the grader's timeout).
A process that spawns many times runs inside `warm_ranks()` (the grader's process for one exercise: every
test of the solution and of each mutant), and so does a Jupyter kernel (a notebook's checks and comparisons):
there ranks are forked from a forkserver that imported torch once, instead of each rank importing it again
(seconds of CPU per rank); each spawn still gets pristine forked ranks.
A GPU profile's ranks are never forked: see `_FORK_SAFE_ENV` (issue 38, G1).
Unverified on hardware here: the NCCL ranks of a GPU profile (the rehearsal runs their code on gloo).
Introduced in notebook 03_ddp.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from labkit.course.exercises.cases import ExerciseError

#: Default seconds before a spawned run is killed.
DEFAULT_TIMEOUT_S = 120.0
#: Seconds the other ranks get to finish after one rank failed, before they are killed.
_FAIL_GRACE_S = 1.0
_POLL_S = 0.05
#: Characters of a rank's captured output relayed to the caller.
_OUTPUT_CHARS = 20_000
_ENTRY = "labkit.course.exercises._rank"
#: What a warm ranks' forkserver imports before it forks any rank. torch._dynamo: every torch.optim optimizer
#: imports it when it is built (1.8 s of CPU a rank; 0.2 s of it come back as a costlier fork).
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "cloudpickle", _ENTRY)


#: A GPU profile's ranks start as fresh interpreters, never as forks of the forkserver: its preloads may
#: have initialised CUDA (04's checks preload transformers' Llama, which imports torchao, whose float8
#: utilities call torch.cuda.is_available()), and a rank forked from a process with CUDA initialised fails
#: at its first CUDA call, `set_device` ("CUDA initialization error", pytorch#17357). This variable, set in
#: the forkserver and every rank, makes is_available() ask NVML instead of initialising CUDA (torch's
#: documented fork-safe check), so the forkserver stays fork-safe for the CPU ranks. Unverified on hardware.
_FORK_SAFE_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


def _child_env(rank: int, world: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    paths = [p for p in [os.getcwd(), *sys.path] if p]
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)), **_FORK_SAFE_ENV)
    return env


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every rank with its group and descendants (the sandbox's tree kill: a rank's own child that
    started a session of its own goes too), then reap them."""
    from labkit.course.grading.confine import kill_process_tree

    for proc in procs:
        if proc.poll() is None:
            kill_process_tree(proc.pid)  # each rank leads its own session/group
    for proc in procs:
        proc.wait()


def _tail(path: Path, chars: int = _OUTPUT_CHARS) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(max(0, size - chars))
        return fh.read().decode("utf-8", "replace")


_WARM = None
"""The forkserver context of this process inside `warm_ranks()` (None: every rank is a fresh interpreter)."""


@contextlib.contextmanager
def warm_ranks():
    """Inside, ranks are forked from a forkserver that imported torch, torch.distributed and the rank entry
    once (`multiprocessing`'s forkserver, started by the first spawn); it is stopped and reaped on the way
    out. Each rank is still a fresh fork of that clean process: nothing one spawn's ranks did reaches the next."""
    import multiprocessing
    from multiprocessing import forkserver

    global _WARM
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    _WARM = ctx
    try:
        yield
    finally:
        _WARM = None
        _stop_forkserver(forkserver)


def prewarm(imports: tuple[str, ...] = ()) -> None:
    """Inside `warm_ranks()`, before any student code: start the forkserver (it imports its preloads and
    `imports` meanwhile) and import torch here, so that a process started ahead of its turn answers at once."""
    _start_forkserver(_WARM, imports)
    import torch  # noqa: F401


def _in_kernel() -> bool:
    """Is this a Jupyter kernel (a notebook's checks and comparisons spawn again and again)?"""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return type(shell).__name__ == "ZMQInteractiveShell"


_KERNEL_WARM = None


def _kernel_warm():
    """The forkserver context of a Jupyter kernel: started by its first spawn, it lives as long as the kernel
    (it exits when the kernel does, and is stopped and reaped at a normal kernel shutdown)."""
    global _KERNEL_WARM
    if _KERNEL_WARM is None:
        import atexit
        import multiprocessing
        from multiprocessing import forkserver

        _KERNEL_WARM = multiprocessing.get_context("forkserver")
        _KERNEL_WARM.set_forkserver_preload(list(_PRELOAD))
        atexit.register(_stop_forkserver, forkserver)
    return _KERNEL_WARM


def _stop_forkserver(forkserver) -> None:
    """Kill and reap the forkserver: it holds nothing to tear down (every rank is reaped by its spawn), and an
    interpreter that imported torch takes a second or more to exit by itself (issue #39)."""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    stop = getattr(forkserver._forkserver, "_stop", None)  # CPython's own (used by its tests; 3.8+)
    if stop is not None:
        with contextlib.suppress(FileNotFoundError):  # its socket's folder went at interpreter exit
            stop()


def _start_forkserver(ctx, imports: tuple[str, ...] = ()) -> None:
    """Start the forkserver (once) with this process's import path, as a fresh rank gets it: Python 3.11's
    forkserver imports its preloads before it would read the caller's sys.path. A spawn whose ranks import
    modules the running forkserver has not (`imports`) stops it and starts one that imports them too: its
    ranks, and every later one, fork with them already imported (a module that fails to import is skipped
    by the forkserver; the rank's own import then reports it)."""
    from multiprocessing import forkserver

    preload = list(getattr(forkserver._forkserver, "_preload_modules", None) or _PRELOAD)
    missing = [m for m in imports if m not in preload]
    if missing:
        _stop_forkserver(forkserver)
        ctx.set_forkserver_preload(preload + missing)

    own = {"PYTHONPATH": _child_env(0, 1, 0)["PYTHONPATH"], **_FORK_SAFE_ENV}
    before = {k: os.environ.get(k) for k in own}
    os.environ.update(own)
    try:
        forkserver.ensure_running()
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


class _Forked:
    """A rank forked by the forkserver, with the Popen methods `spawn` uses (poll, wait, returncode, pid)."""

    def __init__(self, ctx, work: Path, rank: int, env: dict[str, str]):
        self.proc = ctx.Process(target=_forked_rank, args=(str(work), rank, env, os.getcwd()), daemon=False)
        self.proc.start()
        self.pid = self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self) -> int | None:
        self.proc.join()
        return self.proc.exitcode


def _forked_rank(work: str, rank: int, env: dict[str, str], cwd: str) -> None:
    """The forked rank: what `python -m _rank` gets from Popen (own session, log as stdout/stderr, no stdin,
    the caller's directory, environment and import path), then the same `_rank.main`, tied to the forkserver
    (which ends with the caller)."""
    os.setsid()
    # The forkserver hands each child the caller's end of its "alive" pipe (so that a child could use the
    # forkserver in turn); a rank never does, and holding it keeps the forkserver from seeing its caller die:
    # the forkserver then outlives a killed caller, and the ranks tied to it live on (seen: a killed
    # `labkit check` left both ranks running). Closed, the forkserver exits with the caller and the ranks' parent-death signal fires.
    from multiprocessing import forkserver

    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    os.chdir(cwd)
    log = os.open(Path(work) / f"rank_{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (log, 1), (log, 2)):
        os.dup2(fd, target)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = [p for p in env["PYTHONPATH"].split(os.pathsep) if p not in sys.path]
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # the forkserver's torch read its own environment
    from labkit.course.exercises._rank import main

    code = main(work, os.getppid())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _start(work: Path, rank: int, world: int, port: int, imports: tuple[str, ...] = (), *, fork: bool = True):
    """One rank: forked from the forkserver inside `warm_ranks()` or in a Jupyter kernel (unless not `fork`:
    a GPU profile's rank, `_FORK_SAFE_ENV`), else a fresh interpreter."""
    ctx = (_WARM or (_kernel_warm() if _in_kernel() else None)) if fork else None
    if ctx is not None:
        _start_forkserver(ctx, imports)
        return _Forked(ctx, work, rank, _child_env(rank, world, port))
    with open(work / f"rank_{rank}.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", _ENTRY, str(work), str(os.getpid())],
                                env=_child_env(rank, world, port), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _wait(procs: list[subprocess.Popen], timeout: float) -> tuple[int | None, bool]:
    """Wait for every rank; (first failed rank or None, timed out?)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            grace = time.monotonic() + _FAIL_GRACE_S
            while time.monotonic() < grace and any(p.poll() is None for p in procs):
                time.sleep(_POLL_S)
            return failed[0], False
        if all(c == 0 for c in codes):
            return None, False
        time.sleep(_POLL_S)
    return None, True


def _rank_error(rank: int, work: Path, code: int | None) -> ExerciseError:
    import cloudpickle

    err_file = work / f"error_{rank}.pkl"
    if err_file.exists():
        kind, message, tb = cloudpickle.loads(err_file.read_bytes())
        return ExerciseError(f"rank {rank} raised {kind}: {message}", rank=rank, traceback=tb,
                             not_attempted=kind == "NotImplementedError")
    out = _tail(work / f"rank_{rank}.log", 2000).strip()
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    return ExerciseError(f"rank {rank} {how} without a Python error" + (f"; its last output:\n{out}" if out else ""),
                         rank=rank, traceback=out)


def _may_fork(profile: str) -> bool:
    """May this profile's ranks fork from the forkserver? Only CPU ones (`_FORK_SAFE_ENV`)."""
    from labkit.profiles import get_profile

    return get_profile(profile).device != "cuda"


def _check_gpus(profile: str, world: int) -> None:
    """ExerciseError before any rank starts when a GPU profile's node has fewer GPUs than `world`."""
    from labkit.profiles import get_profile

    prof = get_profile(profile)
    if prof.device == "cuda" and world > prof.nproc:
        raise ExerciseError(f"spawn(world={world}) on profile {prof.name!r}: the node has {prof.nproc} GPU(s), one per "
                            f"rank; use world={prof.nproc} or fewer")


def _rehearse(fn: Callable, world: int, args: tuple, profile: str | None) -> list | None:
    """A rehearsal's spawn (labkit.runtime.rehearsal). With a profile: every rank's `fn` in turn in this process,
    over torch's fake process group, on the device the node gives it (`labkit.runtime.device.join_group`, which
    records cuda:r and nccl). Without one the ranks are CPU processes on every profile -- nothing differs
    from the smoke run that executes them -- so a rehearsal skips them: the cell sees "not attempted"."""
    from labkit.runtime import device as devices
    from labkit.profiles import get_profile
    from labkit.train import stand_in

    name = getattr(fn, "__name__", repr(fn))
    if profile is None:
        print(f"rehearsal: spawn({name}) runs CPU ranks on every profile, as in smoke; not re-run here")
        return None
    results = []
    for rank in range(world):
        with stand_in.rank_environment(rank, world, {}):
            try:
                devices.join_group(get_profile(profile), rank, world, local_rank=rank, fake=True)
                results.append(fn(rank, world, *args))
            except Exception as exc:  # noqa: BLE001 - reported like a failed rank
                import traceback
                raise ExerciseError(f"rank {rank} raised {type(exc).__name__}: {exc}", rank=rank,
                                    traceback=traceback.format_exc(),
                                    not_attempted=isinstance(exc, NotImplementedError)) from exc
            finally:
                stand_in.teardown()
    return results


#: Launches tried when the rendezvous port was taken before rank 0 bound it.
_PORT_TRIES = 3


def _port_taken(work: Path, world: int) -> bool:
    """Did a rank fail because the rendezvous port was already in use (the race of `free_port`)?"""
    import cloudpickle

    text = " ".join(_tail(work / f"rank_{r}.log", 4000) for r in range(world))
    text += " ".join(str(cloudpickle.loads(f.read_bytes())[1]) for f in work.glob("error_*.pkl"))
    text = text.lower()
    return "address already in use" in text or "eaddrinuse" in text


def spawn(fn: Callable, world: int = 2, args: tuple = (), timeout: float = DEFAULT_TIMEOUT_S,
          profile: str | None = None, imports: tuple[str, ...] = ()) -> list:
    """Run `fn(rank, world, *args)` on `world` ranks (gloo on CPU, or `profile`'s devices and backend);
    the list of per-rank return values. `imports`: modules `fn` imports that warm ranks should find
    imported (their forkserver imports them once)."""
    import cloudpickle

    from labkit.runtime.launch import free_port

    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"spawn world={world!r}; it must be a positive integer (2 in smoke)")
    if not timeout > 0:
        raise ValueError(f"spawn timeout={timeout!r}; it must be > 0 seconds")
    if profile is not None:
        _check_gpus(profile, world)
    fork = profile is None or _may_fork(profile)
    from labkit.runtime import rehearsal
    if rehearsal.active():
        return _rehearse(fn, world, tuple(args), profile)
    name = getattr(fn, "__name__", repr(fn))
    with tempfile.TemporaryDirectory(prefix="labkit-spawn-") as tmp:
        work = Path(tmp)
        (work / "payload.pkl").write_bytes(cloudpickle.dumps((fn, tuple(args), profile)))
        for attempt in range(_PORT_TRIES):
            # free_port() is free a moment ago; another job can take it before rank 0 binds it (EADDRINUSE):
            # then the ranks start again on a new port, as torchrun's rendezvous would.
            port = free_port()
            procs = []
            try:
                for rank in range(world):
                    procs.append(_start(work, rank, world, port, tuple(imports), fork=fork))
                failed, timed_out = _wait(procs, timeout)
            finally:
                _kill(procs)
            if failed is None or attempt + 1 == _PORT_TRIES or not _port_taken(work, world):
                break
            for stale in work.glob("error_*.pkl"):
                stale.unlink()
        if timed_out:
            raise ExerciseError(f"spawn({name}, world={world}) was still running after {timeout:g} s and was "
                                "killed: a rank waits for a collective another rank never calls, or loops forever")
        if failed is not None:
            # The rank whose own failure came first is the cause; the others then lost their peer (rank_errors).
            from labkit.course.exercises.rank_errors import first_cause

            errors = sorted(work.glob("error_*.pkl"), key=lambda f: f.stat().st_mtime_ns)
            first = first_cause(work, [p.returncode for p in procs])
            if first is None:
                first = int(errors[0].stem.split("_")[1]) if errors else failed
            raise _rank_error(first, work, procs[first].returncode)
        out = _tail(work / "rank_0.log")
        if out:
            print(out, end="" if out.endswith("\n") else "\n")
        return [cloudpickle.loads((work / f"result_{r}.pkl").read_bytes()) for r in range(world)]
