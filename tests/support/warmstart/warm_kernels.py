"""Warm notebook kernels: a kernel forked from a process that already imported torch, not a fresh one.

A notebook kernel pays `import torch` (3.7 CPU s here), transformers' Llama (6.7 s more: it pulls in
torchvision and torch._dynamo) and matplotlib before its first line of lesson runs. `make test` executes
~70 notebooks (every lab in smoke and each rehearsed GPU profile), so that is ~10 minutes of CPU spent
importing the same modules. With `LABKIT_WARM_KERNELS=1`, `labkit.course.notebooks.run_notebook` starts
its kernels through `WarmKernelManager`: a **zygote** (`python -m warmstart.warm_kernels`, one per
environment) imports PRELOAD once and forks one child per kernel; the child becomes exactly what
`python -m ipykernel_launcher -f <connection file>` would be: its own session (the kernel manager
signals its process group: interrupt, shutdown, kill), stdin from /dev/null, the kernel's environment,
working directory and import path.

What a fork could share, and why it does not leak:
- Module state imported before the fork: PRELOAD holds third-party modules only (no labkit: its modules
  read LABKIT_* variables at run time, which differ per notebook). Libraries that read the environment
  when imported (huggingface_hub's HF_HUB_OFFLINE and HF_HOME, matplotlib's MPLBACKEND, torch's
  OMP_NUM_THREADS) saw the kernel's own values: a zygote serves only kernels whose environment equals its
  own apart from VOLATILE keys (LABKIT_*, JPY_*, PYTEST_*); another environment gets another zygote.
  DeepSpeed is preloaded only where the environment already sets DS_ACCELERATOR (a rehearsal's): labkit
  sets it in-process before importing DeepSpeed, after a zygote would have imported it.
- numpy's global random state is reseeded in each child (Python's `random` reseeds itself at fork).
- Nothing runs in the zygote but imports, so no thread, lock or OpenMP pool is held at the fork.
No process outlives its owner: the owner holds the zygote's request pipe; when the owner exits or is
killed the pipe closes and the zygote kills its kernels' process groups and exits; a kernel has the
parent-death signal set to the zygote (and its own children keep their guards: labkit.runtime.rank_guard).
The zygote reaps each kernel and reports its exit status and CPU time (`reaped_cpu`: a forked kernel
is not the owner's child, so the owner's RUSAGE_CHILDREN misses it).
Off by default (a student's and an instructor's notebooks run in a fresh kernel); `make test` turns it
on (tests/conftest.py). The grader never uses it: a submission runs in its sandbox's own fresh kernel.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import uuid
from typing import Any

from warmstart import forking
from warmstart import run_command

#: `1`: run_notebook forks its kernels from a warm zygote (tests/conftest.py sets it for `make test`).
SWITCH_ENV = "LABKIT_WARM_KERNELS"
#: What a zygote imports before it forks any kernel: third-party modules every lab kernel imports.
PRELOAD = ("numpy", "torch", "torch.distributed", "torchvision", "transformers",
           "transformers.models.llama.modeling_llama", "matplotlib", "matplotlib.pyplot",
           "matplotlib_inline.backend_inline", "ipykernel.kernelapp", "ipykernel.ipkernel", "bitsandbytes", "peft")
#: Preloaded only when the zygote's environment (= its kernels') names the variable the module reads when
#: imported: DeepSpeed picks its accelerator then, and labkit sets DS_ACCELERATOR=cpu only before importing it.
PRELOAD_IF_SET = {"deepspeed": "DS_ACCELERATOR"}
#: Environment variables a zygote may differ in from the kernels it forks (read at run time, never at import).
VOLATILE = ("LABKIT_", "JPY_", "PYTEST_")
#: Zygotes kept at once per owner (one per environment; the oldest idle one goes first).
MAX_ZYGOTES = 2
_MODULE = "warmstart.warm_kernels"
_LAUNCHER = "ipykernel_launcher"


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV) == "1"


def _key(prefix: tuple[str, ...], env: dict[str, str]) -> tuple:
    return prefix, tuple(sorted((k, v) for k, v in env.items() if not k.startswith(VOLATILE)))


# ------------------------------------------------------------------------------------ the owner's side
class _Zygote:
    """One zygote process and the kernels it forked, from the owner's side."""

    def __init__(self, prefix: list[str], env: dict[str, str], cwd: str):
        req_r, self._req = os.pipe()  # both ends close-on-exec: only the zygote gets them (pass_fds)
        self._rep, rep_w = os.pipe()
        self.proc = subprocess.Popen([*prefix, *run_command(_MODULE), str(req_r), str(rep_w)], env=env, cwd=cwd,
                                     pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL, start_new_session=True)
        os.close(req_r)
        os.close(rep_w)
        self.exits: dict[int, tuple[int, float]] = {}
        self.live: set[int] = set()
        self.dead = False
        self._forked: list[int] = []
        self._cond = threading.Condition()
        self._lock = threading.Lock()  # one fork request at a time
        threading.Thread(target=self._read, name="warm-kernel-zygote", daemon=True).start()

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._rep, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            with self._cond:
                for line in lines:
                    msg = json.loads(line)
                    if "forked" in msg:
                        self._forked.append(msg["forked"])
                    else:
                        self.exits[msg["exit"]] = (msg["code"], msg["cpu"])
                        self.live.discard(msg["exit"])
                        _REAPED_CPU[0] += msg["cpu"]
                self._cond.notify_all()
        os.close(self._rep)
        self.proc.wait()
        with self._cond:
            self.dead = True  # its kernels died with it (parent-death signal)
            self._cond.notify_all()

    def fork(self, argv: list[str], env: dict[str, str], cwd: str) -> "ForkedKernel":
        with self._lock:
            with self._cond:
                if self.dead:
                    raise RuntimeError("the warm-kernel zygote has exited")
                os.write(self._req, (json.dumps({"argv": argv, "env": env, "cwd": cwd}) + "\n").encode())
                while not self._forked and not self.dead:
                    self._cond.wait()
                if not self._forked:
                    raise RuntimeError("the warm-kernel zygote exited before it forked the kernel")
                pid = self._forked.pop(0)
                self.live.add(pid)
        return ForkedKernel(self, pid)

    def close(self) -> None:
        """Close the request pipe: the zygote kills what it still runs and exits; wait for that."""
        try:
            os.close(self._req)
        except OSError:
            pass
        with self._cond:
            self._cond.wait_for(lambda: self.dead)


class ForkedKernel:
    """A forked kernel with the subprocess.Popen methods jupyter_client's LocalProvisioner uses."""

    stdin = stdout = stderr = None

    def __init__(self, zygote: _Zygote, pid: int):
        self.zygote, self.pid = zygote, pid

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        with self.zygote._cond:
            if self.pid in self.zygote.exits:
                return self.zygote.exits[self.pid][0]
            return -signal.SIGKILL if self.zygote.dead else None

    def wait(self, timeout: float | None = None) -> int:
        with self.zygote._cond:
            if not self.zygote._cond.wait_for(lambda: self.poll() is not None, timeout):
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
        return self.poll()

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


_ZYGOTES: dict[tuple, _Zygote] = {}
_REAPED_CPU = [0.0]
_ZYGOTES_LOCK = threading.Lock()


def reaped_cpu() -> float:
    """CPU seconds (user + system, with their reaped children) of the forked kernels that have exited."""
    return _REAPED_CPU[0]


def zygote_pids() -> list[int]:
    """The running zygotes' process ids (tests)."""
    return [z.proc.pid for z in _ZYGOTES.values() if not z.dead]


def shutdown() -> None:
    """Stop every zygote (and any kernel still running in one). Registered at exit."""
    with _ZYGOTES_LOCK:
        zygotes = list(_ZYGOTES.values())
        _ZYGOTES.clear()
    for zygote in zygotes:
        zygote.close()


atexit.register(shutdown)


def _forkable(cmd: list[str]) -> int | None:
    """The index of `-m` in `cmd` when it is `<this python> [-X...] -m ipykernel_launcher -f <file>`."""
    try:
        at = cmd.index("-m")
    except ValueError:
        return None
    same_python = os.path.realpath(cmd[0]) == os.path.realpath(sys.executable)
    flags_only = all(a.startswith("-X") for a in cmd[1:at])
    if same_python and flags_only and cmd[at + 1:at + 2] == [_LAUNCHER]:
        return at
    return None


def fork_kernel(cmd: list[str], env: dict[str, str], cwd: str) -> ForkedKernel | None:
    """Fork the kernel `cmd` would start from the zygote of its environment (started if needed); None
    when `cmd` is not a plain ipykernel launch of this interpreter (the caller starts it cold)."""
    at = _forkable(cmd)
    if at is None:
        return None
    key = _key(tuple(cmd[:at]), env)
    with _ZYGOTES_LOCK:
        zygote = _ZYGOTES.get(key)
        if zygote is None or zygote.dead:
            idle = [k for k, z in _ZYGOTES.items() if not z.live]
            while len(_ZYGOTES) >= MAX_ZYGOTES and idle:
                _ZYGOTES.pop(idle.pop(0)).close()
            zygote = _ZYGOTES[key] = _Zygote(list(cmd[:at]), dict(env), cwd)
    return zygote.fork(cmd[at + 1:], dict(env), cwd)


def client_options() -> dict[str, Any]:
    """Keyword arguments for papermill / nbclient: the warm kernel manager when enabled(), else labkit's
    plain one (both hand out labkit.course.kernel_client's client, which cannot miss a reply)."""
    from labkit.course.kernel_client import KernelManager

    return {"kernel_manager_class": manager_class() if enabled() else KernelManager}


def manager_class():
    """jupyter_client's AsyncKernelManager whose kernels are forked (`papermill`'s kernel_manager_class)."""
    from jupyter_client.provisioning.local_provisioner import LocalProvisioner

    from labkit.course.kernel_client import KernelManager

    class WarmProvisioner(LocalProvisioner):
        async def launch_kernel(self, cmd, **kwargs):
            env = dict(kwargs.get("env") or os.environ)
            cwd = str(kwargs.get("cwd") or os.getcwd())
            process = fork_kernel(list(cmd), env, cwd)
            if process is None:
                return await super().launch_kernel(cmd, **kwargs)
            self.process, self.pid, self.pgid, self.cwd = process, process.pid, process.pid, cwd  # own session
            return self.connection_info

    class WarmKernelManager(KernelManager):
        async def _async_pre_start_kernel(self, **kw):
            if self.provisioner is None:  # the base class creates jupyter_client's LocalProvisioner otherwise
                self.kernel_id = self.kernel_id or kw.pop("kernel_id", str(uuid.uuid4()))
                self.provisioner = WarmProvisioner(kernel_id=self.kernel_id, kernel_spec=self.kernel_spec, parent=self)
            return await super()._async_pre_start_kernel(**kw)

    return WarmKernelManager


# ------------------------------------------------------------------------------------ the zygote
def _zygote(req_fd: int, rep_fd: int) -> None:
    for name in PRELOAD + tuple(m for m, var in PRELOAD_IF_SET.items() if os.environ.get(var)):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a module that fails here fails (and reports) in the kernel itself
            pass
    children: dict[int, int] = {}  # pidfd -> pid
    buf = b""
    open_requests = True
    while open_requests or children:
        readable, _, _ = select.select([req_fd] * open_requests + list(children), [], [])
        for fd in readable:
            if fd == req_fd:
                chunk = os.read(req_fd, 65536)
                if not chunk:  # the owner is gone: so are its kernels
                    open_requests = False
                    for pid in children.values():
                        try:
                            os.killpg(pid, signal.SIGKILL)
                        except OSError:
                            pass
                    continue
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    pid = os.fork()
                    if pid == 0:
                        _become_kernel(json.loads(line), [req_fd, rep_fd, *children])
                    children[os.pidfd_open(pid)] = pid
                    os.write(rep_fd, (json.dumps({"forked": pid}) + "\n").encode())
            else:
                pid = children.pop(fd)
                os.close(fd)
                _, status, usage = os.wait4(pid, 0)
                cpu = usage.ru_utime + usage.ru_stime
                try:
                    os.write(rep_fd, (json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status),
                                                  "cpu": cpu}) + "\n").encode())
                except OSError:  # the owner is gone
                    pass


def _become_kernel(request: dict[str, Any], close: list[int]) -> None:
    """In the forked child: what `python -m ipykernel_launcher -f <file>` with Popen's arguments gives, then
    the kernel itself. Never returns."""
    def main() -> None:
        forking.become_fresh(request["env"], request["cwd"], close)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        forking.run_module([_LAUNCHER, *request["argv"][1:]])

    forking.run_then_exit(main)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the owner's pipe ends it (own session anyway)
    _zygote(int(sys.argv[1]), int(sys.argv[2]))
