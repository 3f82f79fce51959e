"""Warm torchrun and ranks for the test suite: forked from a process that already imported torch.

torchrun (`python -m torch.distributed.run`, ~5 CPU s of imports) and each rank it starts
(`python -u -m labkit.runtime.rank_guard MODULE ARGS`, labkit.runtime.launch: `import torch`, torch.distributed and
transformers' Llama, ~8 CPU s) pay their imports before their first line of work; `make test` starts
~150 torchruns and ~300 ranks. With LABKIT_RANK_ZYGOTE naming the unix socket of a **manager**
(tests/conftest.py starts one per pytest process), each of them is a thin **shim** instead
(`rank_guard.guarded` starts torchrun as `python -m warmstart.rank_zygote run torch.distributed.run ...`;
rank_guard's main is the ranks' shim): it sends its argv, environment, working directory and its
stdin/stdout/stderr (the files torchrun's `--redirects` opened, the launcher's pipe) to the manager, which
hands them to the **zygote** of that environment (`python -m warmstart.rank_zygote zygote`, one per environment,
started on first use; it imported PRELOAD once). The zygote forks; the child becomes exactly what the cold
command would be after its imports: its own session, the shim's environment, folder, stdio and argv, numpy
reseeded, the module run as `__main__` (a torchrun child names itself in LABKIT_TORCHRUN_PID, as
rank_guard's exec guard does for a cold one, so its ranks' parent checks hold). The shim stays its parent's
child for the whole life of what it stands for, so torchrun and the launcher see what they always see:
- the shim forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 (torchrun's SIGTERM reaches a
  rank's own handler: the hang demo's stack dump);
- the shim exits with the child's exit status (a child killed by a signal: the shim kills itself with it);
- the shim's death is the child's: the child holds the shim's connection and kills itself (and its process
  group) when it closes, SIGKILL included;
- `labkit.runtime.launch.kill_tree` finds the forked stand-ins (`process_tree`: the zygote records which process
  stands for which shim) and stops them as it stops cold ones, ranks first.
What a fork could share, and why it does not leak: as for warm notebook kernels (warmstart.warm_kernels):
PRELOAD is third-party modules only; a zygote serves only ranks whose environment equals its own apart from
VOLATILE keys (torchrun's per-rank variables, LABKIT_*, JPY_*, PYTEST_*), because libraries read some
variables when imported (HF_HUB_OFFLINE, OMP_NUM_THREADS, DS_ACCELERATOR); nothing but imports runs in a
zygote, so no thread, lock or OpenMP pool is held at the fork.
No process outlives its owner: the manager exits when the process that started it (OWNER) does, its
zygotes have their parent-death signal set to it, a rank to its zygote and to its shim's connection.
Test-suite only: nothing sets LABKIT_RANK_ZYGOTE for a student or an instructor (their ranks start cold,
as on a node), the grader's sandbox drops it (labkit.course.grading.sandbox), and when the socket is not
there the shim starts the rank cold. A forked rank's CPU is not the launcher's child CPU (it is the zygote's).
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys

from warmstart import forking
from warmstart import run_command

#: The manager's unix socket path; set (by tests/conftest.py) only where ranks should fork warm.
SWITCH_ENV = "LABKIT_RANK_ZYGOTE"
#: What a zygote imports before it forks any rank: the third-party modules labkit's ranks import.
PRELOAD = ("numpy", "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.elastic.multiprocessing.errors", "torch._dynamo", "torchvision", "transformers",
           "transformers.models.llama.modeling_llama")
#: Preloaded only when the environment names the variable the module reads when imported.
PRELOAD_IF_SET = {"deepspeed": "DS_ACCELERATOR"}
#: Variables that differ between ranks of one environment (torchrun's per-rank ones, labkit's run-time ones).
VOLATILE_PREFIXES = ("LABKIT_", "JPY_", "PYTEST_", "TORCHELASTIC_")
VOLATILE_NAMES = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
                            "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                            "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"})
#: Zygotes a manager keeps (one per environment); the least recently used idle one goes first.
MAX_ZYGOTES = 4
#: Signals the shim passes on to its rank.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_STDIO = 3
_MODULE = "warmstart.rank_zygote"


def _key(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items()
                        if k not in VOLATILE_NAMES and not k.startswith(VOLATILE_PREFIXES)))


def _send(sock: socket.socket, msg: dict, fds: list[int] = ()) -> None:
    data = json.dumps(msg).encode()
    head = struct.pack("!I", len(data))
    if fds:
        socket.send_fds(sock, [head], list(fds))  # the descriptors travel with the length
    else:
        sock.sendall(head)
    sock.sendall(data)


def _recv(sock: socket.socket, maxfds: int = 0) -> tuple[dict | None, list[int]]:
    """One message (and the fds sent with it); (None, []) at end of stream."""
    if maxfds:
        head, fds, _, _ = socket.recv_fds(sock, 4, maxfds)
    else:
        head, fds = sock.recv(4), []
    while head and len(head) < 4:
        more = sock.recv(4 - len(head))
        if not more:
            break
        head += more
    (size,) = struct.unpack("!I", head) if len(head) == 4 else (None,)
    data = b""
    while size is not None and len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            size = None
        data += chunk
    if size is None:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), list(fds)


# ------------------------------------------------------------------------------------ the shim (rank_guard)
def delegate(argv: list[str], kind: str = "rank") -> int | None:
    """In rank_guard (`kind` "rank") or in front of torchrun (`kind` "module", `python -m warmstart.rank_zygote run
    torch.distributed.run ...`): run `argv` (MODULE ARGS) in a process forked by the zygote of this
    environment, pass signals on, and give back its exit status (negative: killed by that signal). None when
    there is no manager to ask (the caller runs MODULE cold)."""
    path = os.environ.get(SWITCH_ENV)
    if not path:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    _send(sock, {"argv": list(argv), "env": dict(os.environ), "cwd": os.getcwd(), "kind": kind, "shim": os.getpid()},
          list(range(_STDIO)))
    reply, _ = _recv(sock)
    if reply is None or "pid" not in reply:
        print(f"warmstart.rank_zygote: no rank was forked ({reply}); the zygote's error is above", file=sys.stderr)
        return 1
    pid = reply["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    reply, _ = _recv(sock)  # a forwarded signal interrupts the wait, which resumes (PEP 475)
    return 1 if reply is None else int(reply["exit"])


def exit_like(code: int) -> None:
    """Leave this process as the rank left: its exit code, or killed by its signal."""
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        os._exit(128 - code)  # a signal whose default is not to end a process
    os._exit(code & 0xFF)


def warm_command(cmd: list[str], env: dict[str, str] | None = None) -> list[str]:
    """`python -m torch.distributed.run ...` as a shim whose torchrun forks warm, when `env` (default: ours)
    names a manager; any other command unchanged."""
    env = os.environ if env is None else env
    if env.get(SWITCH_ENV) and cmd[1:3] == ["-m", "torch.distributed.run"]:
        return [cmd[0], *run_command(_MODULE), "run", *cmd[2:]]
    return cmd


def _forked_dir() -> str | None:
    path = os.environ.get(SWITCH_ENV)
    return os.path.join(os.path.dirname(path), "forked") if path else None


def _register(shim: int | None, pid: int) -> None:
    folder = _forked_dir()
    if folder and shim:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f".{shim}"), "w") as fh:
            fh.write(str(pid))
        os.replace(os.path.join(folder, f".{shim}"), os.path.join(folder, str(shim)))


def forked_for(shim: int) -> int | None:
    """The pid of the process a zygote forked for the shim `shim` (it stands in for it), if any."""
    folder = _forked_dir()
    try:
        with open(os.path.join(folder, str(shim))) as fh:
            return int(fh.read())
    except (TypeError, OSError, ValueError):
        return None


def process_tree(pid: int) -> tuple[list, list]:
    """([process `pid`], [its descendants]) as labkit.runtime.launch.kill_tree stops them (ranks first), with every
    shim replaced by the process a zygote forked for it: signalled once, by the stand-in itself (the shim
    passes its exit on and ends with it), whether torchrun and its ranks started cold or warm."""
    import psutil

    def stand_in(proc):
        forked = forked_for(proc.pid)
        try:
            return psutil.Process(forked) if forked else proc
        except psutil.NoSuchProcess:
            return proc

    try:
        head = [stand_in(psutil.Process(pid))]
    except psutil.NoSuchProcess:
        return [], []
    rest, todo = [], list(head)
    while todo:
        try:
            children = todo.pop().children()
        except psutil.NoSuchProcess:
            continue
        found = [stand_in(child) for child in children]
        rest += found
        todo += found
    return head, rest


# ------------------------------------------------------------------------------------ the manager
def start_manager(path: str, *, max_zygotes: int = MAX_ZYGOTES, preload: tuple[str, ...] = PRELOAD) -> subprocess.Popen:
    """Start a manager listening on `path` for this process (it exits when this process does); wait until
    it listens. The caller sets SWITCH_ENV=path where ranks should fork warm."""
    rd, wr = os.pipe()
    proc = subprocess.Popen([sys.executable, *run_command(_MODULE), "manager", path, str(os.getpid()), str(wr),
                             str(max_zygotes), ",".join(preload)],
                            pass_fds=(wr,), stdin=subprocess.DEVNULL, start_new_session=True)
    os.close(wr)
    os.read(rd, 1)  # the manager writes one byte once it listens (EOF if it died)
    os.close(rd)
    return proc


def stop_manager(proc: subprocess.Popen) -> None:
    """Stop a manager: its zygotes and the ranks they forked follow it (parent-death signals)."""
    proc.terminate()
    proc.wait()


def resident_pids(proc: subprocess.Popen) -> set[int]:
    """The manager's and its zygotes' process ids (not the ranks they forked)."""
    import psutil

    try:
        return {proc.pid, *(child.pid for child in psutil.Process(proc.pid).children())}
    except psutil.NoSuchProcess:
        return set()


def _manager(path: str, owner: int, ready_fd: int, max_zygotes: int, preload: str) -> None:
    forking.set_parent_death_signal()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener.bind(path)
    listener.listen(64)
    os.write(ready_fd, b"1")
    os.close(ready_fd)
    owner_fd = os.pidfd_open(owner)
    zygotes: dict[tuple, tuple[subprocess.Popen, socket.socket]] = {}  # LRU order: oldest first
    retired: list[subprocess.Popen] = []  # closed zygotes still finishing their ranks (reaped when done)
    while True:
        readable, _, _ = select.select([listener, owner_fd], [], [])
        if owner_fd in readable:
            break
        conn, _ = listener.accept()
        fds: list[int] = []
        try:
            request, fds = _recv(conn, _STDIO)
            if request is None:
                continue
            key = _key(request["env"])
            entry = zygotes.pop(key, None)
            if entry is not None and entry[0].poll() is not None:
                entry = None
            if entry is None:
                while len(zygotes) >= max_zygotes:  # the least recently used one finishes its ranks and exits
                    proc, ctl = zygotes.pop(next(iter(zygotes)))
                    ctl.close()
                    retired.append(proc)
                retired[:] = [proc for proc in retired if proc.poll() is None]
                mine, theirs = socket.socketpair()
                proc = subprocess.Popen([sys.executable, "-u", *run_command(_MODULE), "zygote", str(theirs.fileno()), preload],
                                        env=request["env"], cwd=request["cwd"], pass_fds=(theirs.fileno(),),
                                        stdin=subprocess.DEVNULL)
                theirs.close()
                entry = (proc, mine)
            zygotes[key] = entry
            _send(entry[1], request, [conn.fileno(), *fds])
        except OSError:
            pass
        finally:
            conn.close()
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
    for proc in [*(proc for proc, _ in zygotes.values()), *retired]:  # the owner is gone: so are the ranks
        proc.kill()
    try:
        os.unlink(path)
    except OSError:
        pass


# ------------------------------------------------------------------------------------ the zygote
def _zygote(ctl_fd: int, preload: tuple[str, ...]) -> None:
    forking.tie_to_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in preload + tuple(m for m, var in PRELOAD_IF_SET.items() if os.environ.get(var)):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a module that fails here fails (and reports) in the rank itself
            pass
    ctl = socket.socket(fileno=ctl_fd)
    children: dict[int, tuple[int, socket.socket, int]] = {}  # pidfd -> (pid, the shim's connection, its pid)
    open_requests = True
    while open_requests or children:  # closed by the manager (evicted): finish the ranks it runs, then exit
        readable, _, _ = select.select([ctl] * open_requests + list(children), [], [])
        for item in readable:
            if item is ctl:
                request, fds = _recv(ctl, 1 + _STDIO)
                if request is None:
                    open_requests = False
                    continue
                conn = socket.socket(fileno=fds[0])
                pid = os.fork()
                if pid == 0:
                    _become_rank(request, conn, fds[1:], [ctl.fileno(), *children,
                                                          *(c.fileno() for _, c, _ in children.values())])
                for fd in fds[1:]:
                    os.close(fd)
                children[os.pidfd_open(pid)] = (pid, conn, request.get("shim"))
                _register(request.get("shim"), pid)  # before the shim learns the pid: kill_tree can find it
                try:
                    _send(conn, {"pid": pid})
                except OSError:  # the shim is gone already: its rank follows (closed connection)
                    pass
            else:
                pid, conn, shim = children.pop(item)
                os.close(item)
                _, status, _ = os.wait4(pid, 0)
                try:
                    os.unlink(os.path.join(_forked_dir(), str(shim)))
                except (TypeError, OSError):
                    pass
                try:
                    _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                except OSError:
                    pass
                conn.close()
    os._exit(0)


def _become_rank(request: dict, conn: socket.socket, stdio: list[int], close: list[int]) -> None:
    """In the forked child: what the shim's cold command gives after its imports (`python -u -m
    labkit.runtime.rank_guard MODULE ARGS`, or torchrun's `python -m torch.distributed.run ...`), then that. Never returns."""
    def main() -> None:
        forking.become_fresh(request["env"], request["cwd"], close)
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
            os.close(fd)
        _watch_shim(conn)
        if request.get("kind") == "module":  # torchrun: its ranks check that it is their parent
            os.environ[forking.TORCHRUN_PID_ENV] = str(os.getpid())
            forking.run_module(request["argv"])
        else:  # a rank: what labkit.runtime.rank_guard runs after its guard
            forking.run_module(request["argv"], quiet=True)

    forking.run_then_exit(main)


def _watch_shim(conn: socket.socket) -> None:
    """A daemon thread that kills this rank (and its process group) when the shim's connection closes."""
    import threading

    def loop() -> None:
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=loop, name="labkit-shim-watchdog", daemon=True).start()


if __name__ == "__main__":
    if sys.argv[1] == "manager":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _manager(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    elif sys.argv[1] == "run":  # `python -m warmstart.rank_zygote run MODULE ARGS`: MODULE forked warm, else cold
        status = delegate(sys.argv[2:], kind="module")
        if status is None:
            forking.run_module(sys.argv[2:])
        else:
            exit_like(status)
    elif sys.argv[1] == "zygote":
        _zygote(int(sys.argv[2]), tuple(name for name in sys.argv[3].split(",") if name))
