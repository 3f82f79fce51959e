"""The `mount-namespace` isolation level: `isolation.View` built with plain `unshare` where bubblewrap is missing.

`unshare --user --map-root-user --mount --net --pid ...` gives a process that is root in its own user and
mount namespaces; `python -m labkit.course.grading.mountns PLAN -- ARGV` (run there) builds the view bubblewrap
would on a fresh tmpfs root (the plan's binds, symlinks and masks, /proc, /dev, the scratch), pivots into it
and detaches the host's root, makes every mount read-only but the scratch tmpfs and /dev/shm, drops every
capability (root in the namespace could otherwise unmount a mask) and execs ARGV. Mounts inherited from the
host are locked by the kernel (they cannot be unmounted from inside, or made writable again).
"""
from __future__ import annotations

import ctypes
import encodings.unicode_escape  # noqa: F401 - decoded after pivot_root, where the stdlib need not be shown
import errno
import json
import os
import sys
from pathlib import Path

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 4096, 16384, 1 << 21, 1 << 24
_PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 38, 24, 47, 4

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    if _libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {src} on {target}: {os.strerror(err)}")


def _tmpfs(path: str, size: int) -> None:
    _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=755")


def _mountpoint(path: Path, like_dir: bool) -> None:
    if like_dir:
        path.mkdir(parents=True, exist_ok=True)
    elif not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


def _mount_points() -> list[str]:
    """Every mount point of this namespace, deepest last (mountinfo escapes spaces as \\040)."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        raw = line.split()[4]
        points.append(raw.encode().decode("unicode_escape").encode("latin-1").decode(errors="replace"))
    return points


def _remount_ro(point: str) -> None:
    """Read-only, keeping the flags the kernel locks on mounts inherited from the host."""
    st = os.statvfs(point).f_flag
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    flags |= (MS_NOSUID if st & os.ST_NOSUID else 0) | (MS_NODEV if st & os.ST_NODEV else 0)
    flags |= (MS_NOEXEC if st & os.ST_NOEXEC else 0) | (MS_NODIRATIME if st & os.ST_NODIRATIME else 0)
    flags |= MS_NOATIME if st & os.ST_NOATIME else MS_RELATIME if st & os.ST_RELATIME else MS_STRICTATIME
    _mount(None, point, None, flags)


#: pivot_root(2) has no libc wrapper: its syscall number per architecture.
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
_MNT_DETACH = 2


def _inside(root: Path, path: str) -> Path:
    return root / Path(path).relative_to("/")


def apply(plan: dict) -> None:
    """Build the view on a fresh root and enter it: plan ops in order, /proc, /dev, scratch and /dev/shm
    tmpfs, then pivot_root and everything but the scratch and /dev/shm read-only."""
    _mount(None, "/", None, MS_REC | (1 << 18))  # MS_PRIVATE: nothing propagates back to the host
    root = Path(plan["scratch"])  # the new root's tmpfs covers the scratch's host directory: nothing left behind
    _tmpfs(str(root), 2**20)
    for kind, p, source in plan["ops"]:
        target = _inside(root, p)
        if kind == "symlink":
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(source, target)
        elif kind == "bind":
            _mountpoint(target, os.path.isdir(source))
            _mount(source, str(target), None, MS_BIND | MS_REC)
        elif kind == "tmpfs":
            _tmpfs(str(target), 2**20)
        else:  # a private file inside a shown directory
            _mount("/dev/null", str(target), None, MS_BIND)
    for special in ("/proc", "/dev"):
        _mountpoint(_inside(root, special), True)
        _mount(special, str(_inside(root, special)), None, MS_BIND | MS_REC)
    writable = {plan["scratch"], "/dev/shm"}
    for p in sorted(writable):
        _mountpoint(_inside(root, p), True)
        _tmpfs(str(_inside(root, p)), plan["scratch_bytes"])
    old = root / ".old"
    old.mkdir()
    number = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None or _libc.syscall(number, str(root).encode(), str(old).encode()) != 0:
        raise OSError(ctypes.get_errno(), f"pivot_root on {os.uname().machine}")
    os.chdir("/")
    if _libc.umount2(b"/.old", _MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "umount2(/.old)")
    os.rmdir("/.old")
    for point in _mount_points():
        if point in writable or any(point.startswith(w + "/") for w in writable):
            continue
        try:
            _remount_ro(point)
        except OSError as exc:  # a mount point now covered by another mount: nothing reaches it any more
            if exc.errno not in (errno.ENOENT, errno.EACCES, errno.ENOTDIR):
                raise


def drop_privileges() -> None:
    """No capability survives the exec, and none can be regained (setuid binaries included)."""
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last + 1):
        if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m labkit.course.grading.mountns PLAN_JSON -- COMMAND...", file=sys.stderr)
        return 2
    plan = json.loads(argv[0])
    apply(plan)
    drop_privileges()
    os.chdir(plan["scratch"])
    os.execvp(argv[2], argv[2:])
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
