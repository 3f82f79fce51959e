"""One budget of memory and tasks per submission, whatever it forks (`labkit grade`; docs/grading.md).

RLIMIT_AS caps each process: a notebook that forks four children gets four caps. A `Box` caps the whole
tree one sandbox starts (the executor, its kernel, every rank or child they start) together, with the best
mechanism this machine allows (`detect()`, probed once; the `isolation:` line names it):

- `cgroup v2`: a cgroup per sandbox with memory.max (memory.swap.max 0) and pids.max, under the grader's own
  delegated cgroup (`systemd-run --user --scope -p Delegate=yes labkit grade ...`: the grader moves itself into
  a leaf of it, as cgroup v2's no-internal-processes rule requires) or, as root, under the root cgroup.
- `cgroup v1`: the same in the memory and pids hierarchies of a hybrid-cgroup machine where the grader may
  write them (root): memory.limit_in_bytes (and memory.memsw.limit_in_bytes), pids.max.
  Under both, at the cap the kernel's OOM killer stops a process of that sandbox, and only there.
- `polled`: neither (an unprivileged grader without delegation): RLIMIT_NPROC inside the sandbox (its own user
  namespace counts only its own processes, Linux >= 5.14; root ignores it) and the anonymous memory of the
  whole tree read from /proc every POLL_S; the tree is killed over the cap (a burst between two polls can
  pass the cap for that long).

Every sandboxed process starts behind `GUARD`: a bare interpreter that sets the parent-death signal (SIGKILL
when the grader's thread that started it ends, so a killed grader leaves nothing running), joins the box's
cgroups before anything of the sandbox runs (nothing it forks starts outside them), and execs the sandbox.
"""
from __future__ import annotations

import functools
import itertools
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_V2, CGROUP_V1, POLLED, UNCONFINED = "cgroup v2", "cgroup v1", "polled", "unconfined"
#: Tasks (processes and threads: pids.max counts both) one submission may run at once; a torch rank runs ~20.
DEFAULT_TASKS = 1024
#: Seconds between two reads of a polled tree's memory.
POLL_S = 0.2
_counter = itertools.count()

# Runs in a bare interpreter (-I -S): the death signal, a check that the grader (argv[1]) is still the
# parent (it could have died before the prctl), the cgroups (argv[2:] up to '--'), then the sandbox.
GUARD = (
    "import ctypes,os,sys\n"
    "ctypes.CDLL(None).prctl(1, 9)\n"  # PR_SET_PDEATHSIG, SIGKILL
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(70)\n"
    "i = sys.argv.index('--')\n"
    "for f in sys.argv[2:i]:\n"
    "    with open(f, 'w') as fh:\n"
    "        fh.write(str(os.getpid()))\n"
    "os.execv(sys.argv[i + 1], sys.argv[i + 1:])\n"
)


def kill_process_tree(pid: int) -> None:
    """SIGKILL `pid` and every descendant (kernels start their own sessions, so killpg alone misses them)."""
    try:
        import psutil
        children = psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - the process may already be gone
        children = []
    for p in children:
        try:
            p.kill()
        except Exception:  # noqa: BLE001
            pass
    for kill in (os.killpg, os.kill):  # its group (a session leader's), then itself
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass(frozen=True)
class Confinement:
    """How this machine caps one submission's tree: a cgroup version, or polling."""

    kind: str
    detail: str
    """Where the cgroups go, or why there are none."""
    parents: tuple[Path, ...] = ()
    """cgroup v2: (the parent,); cgroup v1: (memory parent, pids parent); polled: ()."""

    def describe(self) -> str:
        if self.kind == POLLED:
            return f"limits per submission: polled (RLIMIT_NPROC, total memory read every {POLL_S:g} s; {self.detail})"
        return f"limits per submission: {self.kind} (memory and tasks of everything it starts; {self.detail})"

    def box(self, memory_bytes: int, tasks: int = DEFAULT_TASKS) -> "Box":
        """A new box with these caps (a polled one when its cgroups cannot be made)."""
        if self.kind in (POLLED, UNCONFINED):
            return Box(self, memory_bytes, tasks)
        name = f"labkit-{os.getpid()}-{next(_counter)}"
        dirs: list[Path] = []
        try:
            for parent in self.parents:
                (parent / name).mkdir()
                dirs.append(parent / name)
            for d in dirs:
                _write_limits(self.kind, d, memory_bytes, tasks)
        except OSError as exc:
            for d in dirs:
                _rmdir(d)
            return Box(Confinement(POLLED, f"{self.kind} failed: {exc.strerror}"), memory_bytes, tasks)
        return Box(self, memory_bytes, tasks, tuple(dirs))


def _write_limits(kind: str, d: Path, memory_bytes: int, tasks: int) -> None:
    files = {CGROUP_V2: {"memory.max": memory_bytes, "memory.swap.max": 0, "pids.max": tasks},
             CGROUP_V1: {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes,
                         "pids.max": tasks}}[kind]
    for name, value in files.items():
        if (d / name).exists():
            try:
                (d / name).write_text(str(value))
            except OSError:
                if name not in ("memory.swap.max", "memory.memsw.limit_in_bytes"):  # no swap accounting: no swap
                    raise


def _rmdir(d: Path) -> None:
    try:
        d.rmdir()
    except OSError:
        pass


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _count(text: str, key: str) -> int:
    """The number after `key` in a flat-keyed cgroup file ("oom_kill 2")."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
            return int(parts[1])
    return 0


@dataclass
class Box:
    """The caps of one sandbox: start it with `command(argv)`, then `watch(proc)`; `exceeded()` says whether
    it hit a cap, `close()` kills what is left and removes the cgroups."""

    confinement: Confinement
    memory_bytes: int
    tasks: int
    dirs: tuple[Path, ...] = ()
    _over: int = 0
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    _after: list = field(default_factory=list, repr=False)

    def on_close(self, fn) -> None:
        """Call `fn()` once `close()` is done (a scratch made outside the sandbox's folder is removed then)."""
        self._after.append(fn)

    @property
    def kind(self) -> str:
        return self.confinement.kind

    def command(self, argv: list[str]) -> list[str]:
        """`argv` (an absolute executable first) behind GUARD: parent-death signal, then this box's cgroups."""
        procs = [str(d / "cgroup.procs") for d in self.dirs]
        return [sys.executable, "-I", "-S", "-c", GUARD, str(os.getpid()), *procs, "--", *argv]

    def child_tasks(self) -> int:
        """RLIMIT_NPROC the sandboxed process sets on itself (polled boxes only; 0: none)."""
        return self.tasks if self.kind == POLLED else 0

    def watch(self, proc) -> None:
        """Start polling `proc`'s tree (polled boxes; a cgroup needs no watcher)."""
        if self.kind == POLLED and self._thread is None:
            self._thread = threading.Thread(target=self._poll, args=(proc.pid,), daemon=True,
                                            name="labkit-memory-poll")
            self._thread.start()

    def _poll(self, pid: int) -> None:
        import psutil

        try:
            root = psutil.Process(pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                return
            total = 0
            for p in tree:
                try:
                    m = p.memory_info()
                    total += max(m.rss - m.shared, 0)  # anonymous memory: shared libraries count once, not per rank
                except psutil.Error:
                    pass
            if total > self.memory_bytes:
                self._over = total
                kill_process_tree(pid)
                return
            self._stop.wait(POLL_S)

    def exceeded(self) -> str:
        """Why this box's processes were stopped by a cap ("" when they were not)."""
        cap = f"{self.memory_bytes / 2**30:.3g} GiB"
        if self._over:
            return (f"its processes together used {self._over / 2**30:.2f} GiB, over the {cap} memory cap of one "
                    "submission; killed")
        for d in self.dirs:
            oom = _read(d / "memory.events") or _read(d / "memory.oom_control")
            hit = _count(oom, "oom_kill") if "oom_kill" in oom else _count(f"n {_read(d / 'memory.failcnt')}", "n")
            if hit:
                return (f"its processes together reached the {cap} memory cap of one submission; the kernel "
                        "stopped them (OOM killer)")
            if _count(_read(d / "pids.events"), "max"):
                return (f"it tried to run more than {self.tasks} processes and threads at once (the cap of one "
                        "submission); forks failed")
        return ""

    def members(self) -> list[int]:
        pids: set[int] = set()
        for d in self.dirs:
            pids |= {int(p) for p in _read(d / "cgroup.procs").split() if p.isdigit()}
        return sorted(pids)

    def kill(self) -> None:
        """SIGKILL every process of the box (with cgroups: also those that left the tree by a double fork)."""
        for d in self.dirs:
            if (d / "cgroup.kill").exists():
                try:
                    (d / "cgroup.kill").write_text("1")
                except OSError:
                    pass
        for pid in self.members():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop polling, kill what is left, remove the cgroups (left in place if a process will not die)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        while self.dirs and time.monotonic() < deadline:
            self.kill()
            if not self.members():
                break
            time.sleep(0.05)
        for d in self.dirs:
            _rmdir(d)
        while self._after:
            self._after.pop()()


def unconfined(memory_bytes: int) -> Box:
    """A box without caps (`labkit check` on a student's own machine): the guard's parent-death signal only."""
    return Box(Confinement(UNCONFINED, "no caps"), memory_bytes, 0)


# ---------------------------------------------------------------- detection
def _own_cgroups() -> dict[str, str]:
    """{controller or "": path} of this process (/proc/self/cgroup; "" is the cgroup v2 line)."""
    out = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for name in parts[1].split(",") if parts[1] else [""]:
                out[name] = parts[2]
    return out


def _cgroup_mounts() -> list[tuple[str, Path, str, set[str]]]:
    """(root inside the hierarchy, mount point, fstype, super options) of every cgroup mount."""
    out = []
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) >= 5 and rest and rest[0] in ("cgroup", "cgroup2"):
            out.append((fields[3], Path(fields[4]), rest[0], set(rest[2].split(",")) if len(rest) > 2 else set()))
    return out


def _dir_of(path: str, root: str, mount: Path) -> Path | None:
    rel = os.path.relpath(path, root)
    return None if rel.startswith("..") else (mount / rel).resolve()


def _sweep(parent: Path) -> None:
    """Remove the empty cgroups graders that died left in `parent`."""
    try:
        for d in parent.glob("labkit-*-*"):
            pid = d.name.split("-")[1]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                _rmdir(d)
    except OSError:
        pass


def _v1() -> Confinement | str:
    own = _own_cgroups()
    parents = []
    for controller in ("memory", "pids"):
        mount = next(((r, m) for r, m, fs, opts in _cgroup_mounts() if fs == "cgroup" and controller in opts), None)
        d = _dir_of(own[controller], mount[0], mount[1]) if mount and controller in own else None
        if d is None or not d.is_dir():
            return f"no cgroup v1 {controller} hierarchy"
        if not os.access(d, os.W_OK):
            return f"cgroup v1 {controller} hierarchy not writable by uid {os.geteuid()}"
        parents.append(d)
    probe = Confinement(CGROUP_V1, "", tuple(parents)).box(2**30, 64)
    if probe.kind != CGROUP_V1:
        return probe.confinement.detail
    probe.close()
    for p in parents:
        _sweep(p)
    return Confinement(CGROUP_V1, f"under {', '.join(map(str, parents))}", tuple(parents))


def _enable(parent: Path) -> bool:
    """memory and pids controllers on for `parent`'s children."""
    if {"memory", "pids"} <= set(_read(parent / "cgroup.subtree_control").split()):
        return True
    try:
        (parent / "cgroup.subtree_control").write_text("+memory +pids")
    except OSError:
        return False
    return True


def _v2() -> Confinement | str:
    mount = next(((r, m) for r, m, fs, _ in _cgroup_mounts() if fs == "cgroup2"), None)
    own = _own_cgroups().get("")
    if mount is None or own is None:
        return "no cgroup v2 hierarchy"
    if not {"memory", "pids"} <= set(_read(mount[1] / "cgroup.controllers").split()):
        return "cgroup v2 without the memory and pids controllers (a hybrid machine)"
    root, mine = mount[1].resolve(), _dir_of(own, mount[0], mount[1])
    if os.access(root / "cgroup.subtree_control", os.W_OK) and _enable(root):  # root: beside systemd's slices
        _sweep(root)
        return Confinement(CGROUP_V2, f"under {root}", (root,))
    if mine is None or not os.access(mine / "cgroup.subtree_control", os.W_OK):
        return (f"cgroup v2 not delegated to uid {os.geteuid()} (run `systemd-run --user --scope -p Delegate=yes "
                "labkit grade ...`)")
    if not {"memory", "pids"} <= set(_read(mine / "cgroup.controllers").split()):
        return f"the delegated cgroup {mine} has no memory and pids controllers"
    others = set(_read(mine / "cgroup.procs").split()) - {str(os.getpid())}
    if others and not _enable(mine):
        return f"the delegated cgroup {mine} holds other processes too (start labkit grade in a scope of its own)"
    try:  # the no-internal-processes rule: this process moves into a leaf, its sandboxes go beside it
        (mine / f"labkit-grader-{os.getpid()}").mkdir(exist_ok=True)
        (mine / f"labkit-grader-{os.getpid()}" / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        return f"cannot move the grader into a leaf of {mine} ({exc.strerror})"
    if not _enable(mine):
        return f"cannot enable memory and pids for the children of {mine}"
    _sweep(mine)
    return Confinement(CGROUP_V2, f"under {mine} (delegated)", (mine,))


@functools.lru_cache(maxsize=None)
def detect() -> Confinement:
    """The best confinement this machine allows this user (probed once per process)."""
    why = []
    for probe in (_v2, _v1):
        try:
            found = probe()
        except OSError as exc:
            found = f"{probe.__name__.strip('_')}: {exc.strerror}"
        if isinstance(found, Confinement):
            return found
        why.append(found)
    return Confinement(POLLED, "; ".join(why))


# ---------------------------------------------------------------- inside the sandbox
def own_user_namespace() -> bool:
    """Is this process in a user namespace of its own (where RLIMIT_NPROC counts only its processes)?"""
    return _read(Path("/proc/self/uid_map")).split() != ["0", "0", "4294967295"]


def cap_tasks(tasks: int) -> bool:
    """In a polled sandbox: at most `tasks` processes and threads, inherited by all it starts. Only in a user
    namespace of its own (elsewhere RLIMIT_NPROC counts every process of the user); root ignores it. True when set."""
    import resource

    if not tasks or not own_user_namespace():
        return False
    resource.setrlimit(resource.RLIMIT_NPROC, (tasks, tasks))
    return True
