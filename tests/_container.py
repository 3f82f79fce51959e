"""Gradescope's container, rehearsed on this machine (tests/test_grading_container.py): run a command as root
the way Docker's defaults run an autograder, with what only the test suite needs here.

    unshare --mount --propagation private -- python tests/_container.py --show P... --cover D -- CMD...

In the private mount namespace `unshare` made (before any restriction, as Docker builds a container before
starting it), then in this order:
1. the image: `--cover D` hides the checkout D but the `--show` paths inside it (an autograder image holds the
   installed labkit, never the course's notebooks/tests/hidden), and each folder above a `--show` path that
   other users cannot traverse (a 0700 checkout or home, where pyenv's Python may live) is covered the same
   way, so the sandbox's user can run the Python and labkit as it can in the image setup.sh builds;
2. Docker's default seccomp profile, in effect (moby's profiles/seccomp/default.json, for a process without
   CAP_SYS_ADMIN): unshare, setns, mount, umount2 and pivot_root -> EPERM; clone with any namespace flag ->
   EPERM; clone3 -> ENOSYS (so the C library falls back to clone, whose flags a filter can read). No
   no_new_privs, as Docker sets none;
3. Docker's default capabilities: every capability outside DOCKER_CAPS dropped from the bounding set, so
   the root that execs CMD has no CAP_SYS_ADMIN (nor CAP_NET_ADMIN, CAP_SYS_PTRACE, ...).
Then CMD is exec'd. Not rehearsed: Docker's read-only /sys/fs/cgroup (cgroups stay writable here when they
are: the sandbox's caps are then a cgroup's, in the container polled) and its AppArmor profile.
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import itertools
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.course.grading import mountns, unprivileged  # noqa: E402

#: Docker's default capabilities (moby oci/caps/defaults.go); every other one is dropped.
DOCKER_CAPS = {0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31}  # chown dac_override fowner fsetid kill setgid
# setuid setpcap net_bind_service net_raw sys_chroot mknod audit_write setfcap
_PR_CAPBSET_DROP = 24
#: Namespace flags of clone(2): CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET.
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)


_spots = itertools.count()


def _cover(folder: Path, keep: list[Path], stage: Path) -> None:
    """A fresh tmpfs over `folder` (mode 0755) holding only `keep` (paths inside it), bound back at their places."""
    staged = []
    keep = [p for p in keep if not any(k in p.parents for k in keep)]  # one bind shows what lies inside it
    for path in keep:
        spot = stage / str(next(_spots))
        spot.mkdir() if path.is_dir() else spot.touch()
        mountns._mount(str(path), str(spot), None, mountns.MS_BIND | mountns.MS_REC)
        staged.append((path, spot))
    mountns._mount("tmpfs", str(folder), "tmpfs", mountns.MS_NOSUID | mountns.MS_NODEV, "mode=755")
    for path, spot in staged:
        for parent in reversed(path.relative_to(folder).parents[:-1]):
            (folder / parent).mkdir(exist_ok=True)
            os.chmod(folder / parent, 0o755)
        path.mkdir() if spot.is_dir() else path.touch()
        mountns._mount(str(spot), str(path), None, 1 << 13)  # MS_MOVE


def build_image(show: list[Path], cover: list[Path], user: unprivileged.User) -> None:
    """Step 1 of the module docstring."""
    mountns._mount(None, "/", None, mountns.MS_REC | (1 << 18))  # MS_PRIVATE: nothing reaches the host
    stage = Path(tempfile.mkdtemp(prefix="labkit-container-"))
    mountns._mount("tmpfs", str(stage), "tmpfs", 0, "mode=700")
    for folder in cover:
        _cover(folder, [p for p in show if folder in p.parents], stage)
    for path in show:
        blocked = next((a for a in reversed(path.parents)
                        if a != Path("/") and not unprivileged._allows(a.stat(), user, 1)), None)
        if blocked is not None:
            _cover(blocked, [p for p in show if blocked in p.parents], stage)
    if mountns._libc.umount2(str(stage).encode(), 2) != 0:  # MNT_DETACH; then the folder leaves the host's /tmp
        raise OSError(ctypes.get_errno(), f"umount2({stage})")
    stage.rmdir()


def docker_seccomp() -> None:
    """Step 2 of the module docstring (pyseccomp over Debian's libseccomp2)."""
    import pyseccomp as seccomp

    f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    f.set_attr(seccomp.Attr.CTL_NNP, 0)
    for name in ("unshare", "setns", "mount", "umount2", "pivot_root"):
        f.add_rule(seccomp.ERRNO(errno.EPERM), name)
    for flag in NAMESPACE_FLAGS:  # rules of one syscall are OR'd: any namespace flag refuses the clone
        f.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    f.load()


def drop_capabilities() -> None:
    """Step 3 of the module docstring."""
    libc = ctypes.CDLL(None, use_errno=True)
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last + 1):
        if cap not in DOCKER_CAPS and libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/_container.py")
    parser.add_argument("--show", type=Path, action="append", default=[])
    parser.add_argument("--cover", type=Path, action="append", default=[])
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    user = unprivileged.sandbox_user()
    if user is None:
        print("no sandbox user on this machine", file=sys.stderr)
        return 2
    build_image([p.resolve() for p in args.show], [p.resolve() for p in args.cover], user)
    docker_seccomp()
    drop_capabilities()
    os.execvp(cmd[0], cmd)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
