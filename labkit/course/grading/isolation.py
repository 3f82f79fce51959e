"""What a sandboxed process can see and touch (`labkit grade`; threat model in docs/grading.md).

Each sandbox (an executed notebook, an exercise's student process) gets a `View` built from nothing: the
system's directories (`SYSTEM`) and what the process needs to run (`runtime_paths`: the Python install and
environment, the installed labkit package and the data it reads, the kernel spec), all read-only at their own
paths, plus one writable scratch directory (a fresh, size-capped tmpfs). Nothing else exists there: not the
repository the package came from (its notebooks/tests/hidden, a release written inside it), not the
submissions, --out, --checks, --autograder, homes or the temp dir. `private` paths are hidden even when they
lie inside a shown one.

Levels, best first:
- `bubblewrap`: Debian's `bwrap` builds the view in new mount, PID, network, IPC and UTS namespaces, with
  every capability dropped (root in the sandbox could otherwise unmount a mask);
- `mount-namespace`: the same view built by labkit.course.grading.mountns inside plain `unshare` user, mount, PID
  and network namespaces, where bubblewrap is missing;
- `unprivileged-user`: no namespace can be made (Docker's default seccomp profile, as on Gradescope; HPC
  nodes without user namespaces) but the grader is root: the student's processes run as an unprivileged user
  (labkit.course.grading.unprivileged), so what keeps the hidden tests out of reach is file permissions.
  It does NOT cut the network, nor hide world-readable files or the process list (that module says what else);
- `none`: no file-system isolation. Network and PID namespaces are still used where `unshare` allows;
  `labkit grade --execute` refuses this level unless `--unsafe-no-isolation` is given.
Memory and tasks are capped per sandbox apart from the view (labkit.course.grading.confine).
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from labkit.course.grading import unprivileged
from labkit.errors import GradingError

BUBBLEWRAP, MOUNT_NS, UNPRIVILEGED, NONE = "bubblewrap", "mount-namespace", unprivileged.LEVEL, "none"


@dataclass(frozen=True)
class Isolation:
    """The isolation this machine gives an executed notebook."""

    level: str
    detail: str
    """One line for the grader, e.g. 'bubblewrap 0.8.0: read-only file system, ...'."""
    network_isolated: bool

    @property
    def isolated(self) -> bool:
        return self.level != NONE


#: System directories every view shows read-only (a symlink, as in merged-/usr systems, stays a symlink).
#: Not /opt, /srv, /home, /root, /tmp, /var, /run or /mnt: a course tree or a release may live there.
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/sys")
#: What of the source tree a sandboxed process needs besides the labkit package (its data lives inside it;
#: labkit.lockfile reads the lock): shown alone, so nothing else of the tree is there.
TREE_RUNTIME = ("requirements/lock.txt",)


@dataclass(frozen=True)
class View:
    """The file system one sandbox sees: SYSTEM and `shown` read-only, one scratch, nothing else."""

    scratch: Path
    """The only writable directory: a fresh tmpfs mounted at this path."""
    scratch_bytes: int
    """Size of the scratch tmpfs (and of /dev/shm): writing more fails with 'No space left on device'."""
    private: tuple[Path, ...] = ()
    """Never visible, even inside a shown path (checks files, --out, submissions, workspace, the autograder)."""
    shown: tuple[Path, ...] = ()
    """Shown read-only at their own paths besides SYSTEM: what the process needs to run (runtime_paths)."""
    network: bool = False


def _within(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def _existing(paths) -> tuple[Path, ...]:
    out = []
    for p in paths:
        try:
            p = Path(p).resolve()
        except (OSError, RuntimeError):
            continue
        if p.exists() and p != Path("/") and p not in out:
            out.append(p)
    return tuple(out)


def mount_plan(view: View) -> list[tuple[str, Path, str]]:
    """The view as ordered (kind, path, source) over an empty root: ('symlink', p, target) recreates a host
    symlink, ('bind', p, host path) shows a host path read-only at p, ('tmpfs', p, '') and ('null', p, '')
    hide a private directory / file that lies inside a shown path."""
    ops: list[tuple[str, Path, str]] = []
    shown: list[Path] = []
    for name in SYSTEM:
        p = Path(name)
        if p.is_symlink():
            ops.append(("symlink", p, os.readlink(p)))
        elif p.is_dir():
            shown.append(p)
    literal = [Path(os.path.abspath(p)) for p in view.shown]
    for p in sorted({*_existing(view.shown), *(p for p in literal if p.exists())}, key=lambda p: len(p.parts)):
        if not any(_within(p, s) for s in shown) and not any(_within(p, Path(s)) for k, s, _ in ops):
            shown.append(p)
    ops += [("bind", p, str(p.resolve())) for p in shown]
    for p in sorted(_existing(view.private), key=lambda p: len(p.parts)):
        if any(_within(p, s) for s in shown):
            ops.append(("tmpfs" if p.is_dir() else "null", p, ""))
    return ops


def bwrap_command(view: View, argv: list[str]) -> list[str]:
    """`bwrap ... -- argv` building `view` on a fresh root."""
    cmd = [shutil.which("bwrap") or "bwrap", "--dev", "/dev", "--proc", "/proc", "--unshare-all",
           *(["--share-net"] if view.network else []), "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    hidden = []
    for kind, p, source in mount_plan(view):
        if kind == "symlink":
            cmd += ["--symlink", source, str(p)]
        elif kind == "bind":
            cmd += ["--ro-bind", source, str(p)]
        elif kind == "tmpfs":
            cmd += ["--tmpfs", str(p)]
            hidden.append(p)
        else:
            cmd += ["--ro-bind", "/dev/null", str(p)]
    cmd += ["--size", str(view.scratch_bytes), "--tmpfs", "/dev/shm",
            "--size", str(view.scratch_bytes), "--tmpfs", str(view.scratch)]
    # The root and the masks are tmpfs: read-only, so they are not free memory for the notebook to fill.
    for p in [Path("/dev"), *hidden, Path("/")]:
        cmd += ["--remount-ro", str(p)]
    return [*cmd, "--chdir", str(view.scratch), "--", *argv]


def unshare_command(view: View, argv: list[str]) -> list[str]:
    """`unshare ... python -m labkit.course.grading.mountns PLAN -- argv` building `view` (level mount-namespace)."""
    plan = {"ops": [(kind, str(p), source) for kind, p, source in mount_plan(view)], "scratch": str(view.scratch),
            "scratch_bytes": view.scratch_bytes}
    ip = shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin") or "ip"
    net = () if view.network else ("--net", "sh", "-c", f'{ip} link set lo up && exec "$@"', "sh")
    return [shutil.which("unshare") or "unshare", "--user", "--map-root-user", "--mount", "--propagation", "private",
            "--pid", "--fork", "--kill-child", "--mount-proc", *net[:1], *net[1:],
            sys.executable, "-m", "labkit.course.grading.mountns", json.dumps(plan), "--", *argv]


def command(iso: Isolation, view: View, argv: list[str], tasks: int = 0) -> list[str]:
    """The command running `argv` under `iso` with `view` (ignored at level none; at level unprivileged-user
    only its private paths are used: GradingError while the student's user can read one). `tasks`: the
    processes the student's user may run at once (level unprivileged-user)."""
    if iso.level == BUBBLEWRAP:
        return bwrap_command(view, argv)
    if iso.level == MOUNT_NS:
        return unshare_command(view, argv)
    if iso.level == UNPRIVILEGED:
        return unprivileged.command(guard_private(view.private), argv, tasks)
    return [*(() if view.network else _unshare_prefix()[0]), *argv]


def guard_private(paths) -> unprivileged.User:
    """At level unprivileged-user: the student's user, after checking it can open none of `paths` (what its
    sandbox must not see); GradingError naming them and the fix otherwise."""
    user = unprivileged.sandbox_user()
    if user is None:
        raise GradingError(f"isolation {UNPRIVILEGED}: none of the users {', '.join(unprivileged.SANDBOX_USERS)} "
                           "exists any more; create one (`useradd --system labkit-student`)")
    seen = unprivileged.exposed(paths, user)
    if seen:
        raise GradingError(unprivileged.exposed_message(seen, user))
    return user


def scratch_dir(iso: Isolation, work: Path) -> Path:
    """The writable directory of a sandbox started in `work` (made here): `work` itself under bubblewrap (its
    tmpfs covers it), `work/scratch` under a mount namespace, a directory of the student's user in the system's
    temp folder at level unprivileged-user (`work` stays the grader's: that user cannot reach it). Give it
    back with `release_scratch`."""
    if iso.level == UNPRIVILEGED:
        user = unprivileged.sandbox_user()
        if user is not None:
            return unprivileged.make_scratch(user)
    scratch = work if iso.level == BUBBLEWRAP else work / "scratch"
    scratch.mkdir(exist_ok=True)  # the mount-namespace level mounts its new root over it
    return scratch


def release_scratch(iso: Isolation, scratch: Path) -> None:
    """After the sandbox ended: remove a scratch made outside its work folder (level unprivileged-user)."""
    if iso.level == UNPRIVILEGED:
        unprivileged.remove_scratch(scratch)


def runtime_paths(kernel: str) -> tuple[Path, ...]:
    """What a sandboxed process needs readable besides SYSTEM: the Python install and environment, the user
    site, the installed labkit package and TREE_RUNTIME beside it, the kernel spec, the DeepSpeed op cache.
    Never the tree the package sits in (its notebooks/tests/hidden, a release written inside it)."""
    import site

    import labkit

    package = Path(labkit.__file__).resolve().parent
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, Path(sys.executable).resolve().parents[1], package,
             *[package.parent / p for p in TREE_RUNTIME]]
    if site.ENABLE_USER_SITE:
        paths.append(site.getusersitepackages())
    spec = kernel_spec_dir(kernel)
    if spec is not None:
        paths.append(spec)
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        paths.append(os.environ["TORCH_EXTENSIONS_DIR"])
    return _existing(paths)


def kernel_spec_dir(kernel: str) -> Path | None:
    try:
        from jupyter_client.kernelspec import KernelSpecManager
        return Path(KernelSpecManager().get_kernel_spec(kernel).resource_dir).resolve()
    except Exception:  # noqa: BLE001 - no such kernel: papermill names it when the run starts
        return None


def _probe(level: str, network: bool) -> str | None:
    """None when `level` builds a view on this machine, else why not (last line of its error). At level
    unprivileged-user the probe is the sandbox's Python importing the sandbox's module as the student's user."""
    argv = [sys.executable, "-c", "import labkit.course.grading.sandbox"] if level == UNPRIVILEGED else ["true"]
    with tempfile.TemporaryDirectory(prefix="labkit-probe-") as tmp:
        scratch = Path(tmp).resolve()
        view = View(scratch, 2**20, network=network)
        try:
            probe = subprocess.run(command(Isolation(level, "", False), view, argv), capture_output=True,
                                   timeout=60, env={**os.environ, "PYTHONPATH": labkit_path()}, cwd="/")
        except (OSError, subprocess.TimeoutExpired) as exc:
            return str(exc)[:120]
    if probe.returncode == 0:
        return None
    return (probe.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1][:120]


def labkit_path() -> str:
    """PYTHONPATH with the directory holding this labkit first (the sandboxed processes import the same one)."""
    from labkit.course import source_tree

    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([str(source_tree()), *rest])


@functools.lru_cache(maxsize=None)
def detect(network: bool = False) -> Isolation:
    """The best isolation this machine allows (probed once per process)."""
    from labkit.course.grading import confine

    net = "network allowed" if network else "no network"
    hidden = (f"only the system, the Python environment and the labkit package visible, read-only; private "
              f"scratch tmpfs; {net}; own PID namespace; {confine.detect().describe()}")
    why = "bubblewrap not installed: `sudo apt-get install bubblewrap` (`make test` installs it)"
    if shutil.which("bwrap"):
        failed = _probe(BUBBLEWRAP, network)
        if failed is None:
            version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
            return Isolation(BUBBLEWRAP, f"{version or 'bubblewrap'}: {hidden}", not network)
        why = f"bubblewrap failed: {failed}"
    if shutil.which("unshare"):
        failed = _probe(MOUNT_NS, network)
        if failed is None:
            return Isolation(MOUNT_NS, f"unshare (no bubblewrap: {why}): {hidden}",
                             not network)
        why += f"; unshare failed: {failed}"
    found = _unprivileged_level(network, why)
    if isinstance(found, Isolation):
        return found
    why += f"; {found}"
    prefix, net = ((), "network allowed") if network else _unshare_prefix()
    return Isolation(NONE, f"file system NOT isolated ({why}); {net}; {confine.detect().describe()}", bool(prefix))


def _unprivileged_level(network: bool, why: str) -> Isolation | str:
    """Level unprivileged-user when the grader is root, a sandbox user exists and can run this Python and
    labkit (probed: it imports the sandbox's module as that user); else why not."""
    from labkit.course.grading import confine

    user = unprivileged.sandbox_user()
    if os.geteuid() != 0:
        return f"{UNPRIVILEGED} needs a grader running as root (to start the student's code as another user)"
    if user is None or not shutil.which("setpriv"):
        return (f"{UNPRIVILEGED} needs util-linux's setpriv and one of the users "
                f"{', '.join(unprivileged.SANDBOX_USERS)} (`useradd --system labkit-student`)")
    closed = unprivileged.closed([sys.executable, *runtime_paths("labkit"), labkit_path().split(os.pathsep)[0]], user)
    if closed:
        return (f"{UNPRIVILEGED}: user {user} cannot read {closed[0]} (install the Python environment and labkit "
                "where every user can read them: setup.sh does)")
    failed = _probe(UNPRIVILEGED, network)
    if failed is not None:
        return f"{UNPRIVILEGED} failed: {failed}"
    net = "network NOT cut (no namespaces here: a submission reaches what this machine can)"
    if network:
        net = "network allowed"
    return Isolation(UNPRIVILEGED, f"runs as {user} (no namespaces: {why}): the hidden tests and grader files "
                     f"readable by root only; its own scratch on disk (each file capped, not the total); {net}; "
                     f"other processes listed in /proc; {confine.detect().describe()}", False)


@functools.lru_cache(maxsize=1)
def _unshare_prefix() -> tuple[tuple[str, ...], str]:
    """(command prefix, description): network+PID namespaces if this machine allows them, else ()."""
    unshare, ip = shutil.which("unshare"), shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin")
    if not unshare or not ip:
        return (), "network NOT isolated (`unshare` or `ip` not found)"
    base = (unshare, "--net", "--pid", "--fork", "--kill-child", "--mount-proc")
    tail = ("sh", "-c", f'{ip} link set lo up && exec "$@"', "sh")
    # Root can create the namespaces directly; anyone else needs a user namespace mapping them to root in it
    # (which also keeps them from raising their resource limits).
    candidates = ([base + tail] if os.geteuid() == 0 else []) + [base + ("--user", "--map-root-user") + tail]
    why = "no message"
    for prefix in candidates:
        try:
            probe = subprocess.run(prefix + ("true",), capture_output=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = str(exc)
            continue
        if probe.returncode == 0:
            return prefix, "no network (new network namespace)"
        why = (probe.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
    return (), f"network NOT isolated (unshare failed: {why[:120]})"
