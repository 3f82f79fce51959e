"""The `unprivileged-user` isolation level: where no namespace can be made (Gradescope's Docker containers,
many HPC login nodes), the student's processes run as another, unprivileged user (docs/grading.md).

Docker's default seccomp profile refuses unshare, setns and clone with namespace flags to a process without
CAP_SYS_ADMIN, so neither bubblewrap nor `unshare` can start there. A grader running as root can still start
the student's executor, kernel and exercise process as a user of their own (`SANDBOX_USERS`: setup.sh creates
`labkit-student`, else `nobody`), through util-linux's `setpriv`: real and effective ids changed, no
supplementary group, no new privileges (a setuid program cannot give root back), the parent-death signal kept.

What this level keeps from the student's code: every file the user cannot read. The hidden tests and every
grader file must then be readable by root only: the grader's workspaces are (0700), run_autograder makes
/autograder/source and /autograder/submission so, and `command()` refuses to start a sandbox while a private
path is still readable by the user (`exposed`). The scratch is a fresh directory of the user's own in the
system's temp folder, removed with the sandbox.

What it does NOT cut (say so wherever the level is named):
- the network: without a network namespace there is no way to cut it (an owner match in iptables needs
  CAP_NET_ADMIN, which Docker drops); a submission can reach what the container can;
- the view of the system: world-readable files (/etc, /usr, the Python environment, the installed labkit) and
  the list of processes in /proc (their command lines; never another user's files, environment or descriptors);
- the scratch's total size: a directory on disk, not a size-capped tmpfs; RLIMIT_FSIZE caps each file;
- processes that leave the tree by a double fork, where no cgroup is writable (Docker mounts /sys/fs/cgroup
  read-only): they end with the container, or with the sandbox (`sweep`);
- two sandboxes at once: both run as the same user and could reach each other's scratch, so `labkit grade`
  grades one submission at a time at this level (--workers 1), as run_autograder always does.
"""
from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

LEVEL = "unprivileged-user"
#: Users the student's processes may run as, first found wins: setup.sh's own, else the system's `nobody`.
SANDBOX_USERS = ("labkit-student", "nobody")


@dataclass(frozen=True)
class User:
    """The account the student's processes run as."""

    name: str
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"{self.name} (uid {self.uid})"


def sandbox_user() -> User | None:
    """The first of SANDBOX_USERS this machine has (never root), else None."""
    for name in SANDBOX_USERS:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        if entry.pw_uid != 0:
            return User(name, entry.pw_uid, entry.pw_gid)
    return None


def _allows(st: os.stat_result, user: User, bit: int) -> bool:
    """Does `st`'s mode give `user` the permission `bit` (4 read, 1 traverse/execute)? Owner, then group, then
    others, as the kernel decides (ACLs are not read: a path they open is reported as closed)."""
    if st.st_uid == user.uid:
        return bool(st.st_mode & (bit << 6))
    if st.st_gid == user.gid:
        return bool(st.st_mode & (bit << 3))
    return bool(st.st_mode & bit)


def reachable(path: str | os.PathLike, user: User) -> bool:
    """Can `user` open `path`: every folder above it traversable, the path itself readable (a folder: readable
    or traversable, so a name inside it can be opened)? Symlinks are followed. False when it does not exist."""
    try:
        target = Path(path).resolve(strict=True)
        for parent in reversed(target.parents):
            if not _allows(parent.stat(), user, 1):
                return False
        st = target.stat()
    except OSError:
        return False
    if stat.S_ISDIR(st.st_mode):
        return _allows(st, user, 4) or _allows(st, user, 1)
    return _allows(st, user, 4)


def closed(paths, user: User) -> list[Path]:
    """Of `paths` (what a sandbox needs), those `user` cannot open."""
    return [Path(p) for p in paths if not reachable(p, user)]


def exposed(paths, user: User) -> list[Path]:
    """Of `paths` (what a sandbox must not see), those `user` can open."""
    return [Path(p) for p in paths if os.path.lexists(p) and reachable(p, user)]


def exposed_message(paths: list[Path], user: User) -> str:
    """The error for private paths the student's user could read, with the fix."""
    names = ", ".join(map(str, paths[:3])) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    quoted = " ".join(f"'{p}'" for p in paths[:3])
    return (f"the student's code runs as {user} here (no namespaces on this machine), and that user can read "
            f"{names}; make it readable by the grader only (`chmod go-rwx {quoted}`: no one else can then open what is inside), or grade where "
            "bubblewrap can start")


def command(user: User, argv: list[str], tasks: int = 0) -> list[str]:
    """`argv` run as `user`: setpriv changes the ids, clears the groups, forbids new privileges and keeps the
    parent-death signal (a credential change clears it); prlimit caps the user's processes first (RLIMIT_NPROC
    counts every process of the user: a dedicated user makes it this sandbox's cap)."""
    setpriv = shutil.which("setpriv") or shutil.which("setpriv", path="/usr/bin:/bin") or "setpriv"
    prefix = [setpriv, f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--no-new-privs",
              "--inh-caps=-all", "--pdeathsig=keep"]
    prlimit = shutil.which("prlimit")
    if tasks and prlimit:
        prefix = [prlimit, f"--nproc={tasks}:{tasks}", "--", *prefix]
    return [*prefix, *argv]


def scratch_parent() -> Path:
    """Where the users' scratch directories go: the system's temp folder (traversable by every user)."""
    return Path(tempfile.gettempdir())


_open: dict[Path, User] = {}  # the scratches of this grader's running sandboxes
_lock = threading.Lock()


def make_scratch(user: User) -> Path:
    """A fresh directory owned by `user`, mode 0700, in scratch_parent(); remove it with `remove_scratch`."""
    path = Path(tempfile.mkdtemp(prefix="labkit-sandbox-", dir=scratch_parent()))
    os.chown(path, user.uid, user.gid)
    with _lock:
        _open[path] = user
    return path


def remove_scratch(path: Path) -> None:
    """Remove a scratch the sandbox wrote (as root: whatever modes the student's code set inside). The last
    sandbox of this grader to end also ends what its user left running (`sweep`)."""
    with _lock:
        user = _open.pop(path, None)
        last = user is not None and user not in _open.values()
    if last:
        sweep(user)
    shutil.rmtree(path, ignore_errors=True)


def sweep(user: User) -> int:
    """SIGKILL what sandboxes left running as `user` (a double fork leaves the tree; without a writable cgroup
    nothing else finds it): every process of labkit-student, and those of another user (`nobody` may run other
    services) whose environment names a sandbox's scratch (a process that rewrote its environment escapes
    this: create labkit-student). Call only when no sandbox of this grader runs; returns how many."""
    import signal

    import psutil

    killed = 0
    for p in psutil.process_iter(["uids"]):
        try:
            if not p.info["uids"] or p.info["uids"].real != user.uid:
                continue
            if user.name != SANDBOX_USERS[0] and not any("labkit-sandbox-" in v for v in p.environ().values()):
                continue
            p.send_signal(signal.SIGKILL)
            killed += 1
        except psutil.Error:
            pass
    return killed
