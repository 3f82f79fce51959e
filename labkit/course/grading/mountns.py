"""The `mount-namespace` isolation level: `isolation.View` built with plain `unshare` where bubblewrap is missing.

`unshare --user --map-root-user --mount --net --pid ...` gives a process that is root in its own user and
mount namespaces; `python -m labkit.course.grading.mountns PLAN -- ARGV` (run there) applies the same mount plan
bubblewrap would, makes every mount read-only but the scratch tmpfs and /dev/shm, drops every capability
(root in the namespace could otherwise unmount a mask) and execs ARGV. Mounts inherited from the host are
locked by the kernel (they cannot be unmounted from inside, or made writable again).
"""
from __future__ import annotations

import ctypes
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


def apply(plan: dict) -> None:
    """Build the view: masks and binds in plan order, scratch and /dev/shm tmpfs, all else read-only."""
    _mount(None, "/", None, MS_REC | (1 << 18))  # MS_PRIVATE: nothing propagates back to the host
    ops = plan["ops"]
    # Sources are opened before anything is masked: a bind re-shows what a mask just covered.
    fds = {p: os.open(p, os.O_PATH | os.O_NOFOLLOW) for kind, p in ops if kind == "bind"}
    for kind, p in ops:
        if kind == "tmpfs":
            _tmpfs(p, 2**20)
        elif kind == "bind":
            _mountpoint(Path(p), os.path.isdir(f"/proc/self/fd/{fds[p]}"))
            _mount(f"/proc/self/fd/{fds[p]}", p, None, MS_BIND | MS_REC)
        else:
            os.symlink(plan["links"][p], p)
    for fd in fds.values():
        os.close(fd)
    writable = {plan["scratch"], "/dev/shm"}
    for p in sorted(writable):
        Path(p).mkdir(parents=True, exist_ok=True)  # the scratch's host directory may sit under a mask now
        _tmpfs(p, plan["scratch_bytes"])
    for point in _mount_points():
        if point in writable or any(point.startswith(w + "/") for w in writable):
            continue
        try:
            _remount_ro(point)
        except OSError as exc:  # a mount point now covered by a mask: nothing reaches it any more
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
