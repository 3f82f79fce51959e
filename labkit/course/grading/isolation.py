"""What an executed submission can see and touch (`labkit grade --execute`; threat model in docs/grading.md).

Each execution gets a `View`: the whole file system read-only, one writable scratch directory (a fresh,
size-capped tmpfs), and some paths that are not there at all: the private ones (checks files, the --out
folder, the submissions, the grader's workspace) and the masked ones (homes, the temp dir), inside which
only what the kernel needs to start (the venv, the Python install, labkit's source, the kernel spec) is
bound back, read-only.

Levels, best first:
- `bubblewrap`: Debian's `bwrap` builds the view in new mount, PID, network, IPC and UTS namespaces, with
  every capability dropped (root in the sandbox could otherwise unmount a mask);
- `mount-namespace`: the same view built by labkit.course.grading.mountns inside plain `unshare` user, mount, PID
  and network namespaces, where bubblewrap is missing;
- `none`: no file-system isolation. Network and PID namespaces are still used where `unshare` allows;
  `labkit grade --execute` refuses this level unless `--unsafe-no-isolation` is given.
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

BUBBLEWRAP, MOUNT_NS, NONE = "bubblewrap", "mount-namespace", "none"


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


@dataclass(frozen=True)
class View:
    """The file system one execution sees."""

    scratch: Path
    """The only writable directory: a fresh tmpfs mounted at this path."""
    scratch_bytes: int
    """Size of the scratch tmpfs (and of /dev/shm): writing more fails with 'No space left on device'."""
    private: tuple[Path, ...] = ()
    """Never visible, whatever else is needed (checks files, --out, submissions, workspace)."""
    masked: tuple[Path, ...] = ()
    """Hidden, except the `needed` paths inside them (homes, the temp dir)."""
    needed: tuple[Path, ...] = ()
    """Bound back read-only when inside a masked path: what the kernel needs to start."""
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


def mount_plan(view: View) -> list[tuple[str, Path]]:
    """Ordered mounts over a read-only `/`: ('tmpfs', p) hides p, ('bind', p) shows host p read-only,
    ('symlink', p) recreates the host symlink p. Applied shallowest first, so a later mount can re-hide
    inside what an earlier one showed (a checks file inside the source tree that must be shown)."""
    private, masked = _existing(view.private), _existing(view.masked)
    needed = tuple(n for n in _existing(view.needed) if not any(_within(n, p) for p in private))
    events = {(len(p.parts), 0, "mask", p) for p in masked + tuple(p for p in private if p.is_dir())}
    # A private file is hidden by masking its directory and showing the directory's other entries again.
    events |= {(len(p.parent.parts), 2, "except", p.parent) for p in private if not p.is_dir()}
    events |= {(len(n.parts), 1, "expose", n) for n in needed}
    state: list[tuple[Path, str, frozenset]] = []  # (path, "mask" | "show" | "except", entries kept)

    def visible(p: Path) -> bool:
        best, seen = (-1, True), True
        for path, kind, keep in state:
            if not _within(p, path) or len(path.parts) < best[0]:
                continue
            if kind == "except" and p != path:
                seen = path / p.relative_to(path).parts[0] in keep
            else:
                seen = kind != "mask"
            best = (len(path.parts), seen)
        return best[1]

    ops: list[tuple[str, Path]] = []
    for _, _, kind, p in sorted(events):
        if kind == "mask" and visible(p):
            ops.append(("tmpfs", p))
            state.append((p, "mask", frozenset()))
        elif kind == "expose" and not visible(p):
            ops.append(("bind", p))
            state.append((p, "show", frozenset()))
        elif kind == "except" and visible(p):
            keep = frozenset(c for c in p.iterdir() if c not in private)
            ops.append(("tmpfs", p))
            ops += [("symlink" if c.is_symlink() else "bind", c) for c in sorted(keep)]
            state.append((p, "except", keep))
    return ops


def bwrap_command(view: View, argv: list[str]) -> list[str]:
    """`bwrap ... -- argv` building `view`."""
    cmd = [shutil.which("bwrap") or "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
           "--unshare-all", *(["--share-net"] if view.network else []), "--die-with-parent", "--new-session",
           "--cap-drop", "ALL", "--size", str(view.scratch_bytes), "--tmpfs", "/dev/shm"]
    hidden = []
    for kind, p in mount_plan(view):
        if kind == "tmpfs":
            cmd += ["--tmpfs", str(p)]
            hidden.append(p)
        elif kind == "bind":
            cmd += ["--ro-bind", str(p), str(p)]
        else:
            cmd += ["--symlink", os.readlink(p), str(p)]
    cmd += ["--size", str(view.scratch_bytes), "--tmpfs", str(view.scratch)]
    # Masks are empty tmpfs: read-only, so they are not free memory for the notebook to fill.
    for p in [Path("/dev"), *hidden]:
        cmd += ["--remount-ro", str(p)]
    return [*cmd, "--chdir", str(view.scratch), "--", *argv]


def unshare_command(view: View, argv: list[str]) -> list[str]:
    """`unshare ... python -m labkit.course.grading.mountns PLAN -- argv` building `view` (level mount-namespace)."""
    ops = mount_plan(view)
    plan = {"ops": [(kind, str(p)) for kind, p in ops], "scratch": str(view.scratch),
            "scratch_bytes": view.scratch_bytes, "links": {str(p): os.readlink(p) for k, p in ops if k == "symlink"}}
    ip = shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin") or "ip"
    net = () if view.network else ("--net", "sh", "-c", f'{ip} link set lo up && exec "$@"', "sh")
    return [shutil.which("unshare") or "unshare", "--user", "--map-root-user", "--mount", "--propagation", "private",
            "--pid", "--fork", "--kill-child", "--mount-proc", *net[:1], *net[1:],
            sys.executable, "-m", "labkit.course.grading.mountns", json.dumps(plan), "--", *argv]


def command(iso: Isolation, view: View, argv: list[str]) -> list[str]:
    """The command running `argv` under `iso` with `view` (ignored at level none)."""
    if iso.level == BUBBLEWRAP:
        return bwrap_command(view, argv)
    if iso.level == MOUNT_NS:
        return unshare_command(view, argv)
    return [*(() if view.network else _unshare_prefix()[0]), *argv]


def default_masked() -> tuple[Path, ...]:
    """Homes (the grader's and every user's) and the temp dir (other executions' scratch lives there)."""
    return _existing([Path.home(), os.environ.get("HOME", "/root"), "/root", "/home", tempfile.gettempdir()])


def runtime_paths(kernel: str) -> tuple[Path, ...]:
    """What the kernel needs readable: the Python install and venv, sys.path, labkit and the kernel spec."""
    import labkit

    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, Path(sys.executable).resolve().parents[1],
             Path(labkit.__file__).resolve().parents[1], *[p for p in sys.path if p],
             *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    spec = kernel_spec_dir(kernel)
    if spec is not None:
        paths.append(spec)
    return _existing(paths)


def kernel_spec_dir(kernel: str) -> Path | None:
    try:
        from jupyter_client.kernelspec import KernelSpecManager
        return Path(KernelSpecManager().get_kernel_spec(kernel).resource_dir).resolve()
    except Exception:  # noqa: BLE001 - no such kernel: papermill names it when the run starts
        return None


def _probe(level: str, network: bool) -> str | None:
    """None when `level` builds a view on this machine, else why not (last line of its error)."""
    with tempfile.TemporaryDirectory(prefix="labkit-probe-") as tmp:
        scratch = Path(tmp).resolve()
        view = View(scratch, 2**20, masked=(scratch.parent,), network=network)
        try:
            probe = subprocess.run(command(Isolation(level, "", False), view, ["true"]), capture_output=True,
                                   timeout=30, env={**os.environ, "PYTHONPATH": labkit_path()})
        except (OSError, subprocess.TimeoutExpired) as exc:
            return str(exc)[:120]
    if probe.returncode == 0:
        return None
    return (probe.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1][:120]


def labkit_path() -> str:
    """PYTHONPATH with the directory holding this labkit first (the sandboxed processes import the same one)."""
    import labkit

    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([str(Path(labkit.__file__).resolve().parents[1]), *rest])


@functools.lru_cache(maxsize=None)
def detect(network: bool = False) -> Isolation:
    """The best isolation this machine allows (probed once per process)."""
    net = "network allowed" if network else "no network"
    hidden = f"private scratch tmpfs, checks/--out/other submissions/homes hidden, {net}, own PID namespace"
    why = "bubblewrap not installed: `sudo apt-get install bubblewrap` (`make test` installs it)"
    if shutil.which("bwrap"):
        failed = _probe(BUBBLEWRAP, network)
        if failed is None:
            version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
            return Isolation(BUBBLEWRAP, f"{version or 'bubblewrap'}: read-only file system, {hidden}", not network)
        why = f"bubblewrap failed: {failed}"
    if shutil.which("unshare"):
        failed = _probe(MOUNT_NS, network)
        if failed is None:
            return Isolation(MOUNT_NS, f"unshare (no bubblewrap: {why}): read-only file system, {hidden}",
                             not network)
        why += f"; unshare failed: {failed}"
    prefix, net = ((), "network allowed") if network else _unshare_prefix()
    return Isolation(NONE, f"file system NOT isolated ({why}); {net}", bool(prefix))


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
