"""One budget per submission, whatever it forks, and nothing outlives its grader (issue #26; labkit.course.grading.confine).

The memory cap of `labkit grade` is the whole sandbox's: children share it (a cgroup where the machine allows
it, else polled); tasks are capped the same way; every sandboxed process dies with the grader's thread that
started it, sandboxed or not (the `labkit check` path of tests/test_exercises_ci.py included).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from nbformat.v4 import new_code_cell

from conftest import command_line
from labkit.course.exercises.source import exercise_id
from labkit.course.grading import confine, unprivileged

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
NOBODY = unprivileged.User("nobody", 65534, 65534)  # the unprivileged user of _unprivileged()

#: A parent that starts four 200 MiB children and says how many held their memory together.
FOUR_CHILDREN = textwrap.dedent('''
    import subprocess, sys
    child = "import time; b = b'\\\\x01' * (200 * 2**20); time.sleep(3)"
    procs = [subprocess.Popen([sys.executable, "-c", child]) for _ in range(4)]
    print("held at once:", sum(p.wait() == 0 for p in procs), flush=True)
''')


def _run_boxed(conf: confine.Confinement, code: str, memory: int, tasks: int = confine.DEFAULT_TASKS):
    box = conf.box(memory, tasks)
    proc = subprocess.Popen(box.command([sys.executable, "-c", code]), stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    box.watch(proc)
    out, _ = proc.communicate(timeout=300)
    reason = box.exceeded()
    box.close()
    assert all(not d.exists() for d in box.dirs)  # the cgroups are removed with the box
    return out, reason


@pytest.mark.parametrize("kind", ["detected", confine.POLLED])
def test_children_share_one_memory_cap(kind):
    """Four 200 MiB children under a 500 MiB cap: at most two hold their memory at once (RLIMIT_AS alone, a
    per-process cap, let all four do it); the box names the cap."""
    conf = confine.detect() if kind == "detected" else confine.Confinement(confine.POLLED, "forced by the test")
    out, reason = _run_boxed(conf, FOUR_CHILDREN, 500 * MIB)
    held = [int(n) for n in out.split()[-1:] if n.isdigit()]
    assert "memory cap of one submission" in reason, (conf, out, reason)
    assert held == [] if conf.kind == confine.POLLED else held and held[0] <= 2, (out, reason)  # polled: all killed


def test_tasks_are_capped_for_the_whole_sandbox(confine_file):
    """40 forks under a cap of 16 tasks: the cgroup's pids.max, or RLIMIT_NPROC where the sandbox has its own
    user namespace (what the polled confinement sets in the sandboxed process)."""
    forks = textwrap.dedent('''
        import os, time
        made = 0
        for _ in range(40):
            try:
                if os.fork() == 0:
                    time.sleep(2)
                    os._exit(0)
                made += 1
            except OSError:
                pass
        print("forked", made, flush=True)
    ''')
    conf = confine.detect()
    if conf.kind in (confine.CGROUP_V1, confine.CGROUP_V2):
        out, reason = _run_boxed(conf, forks, 2**30, tasks=16)
        assert int(out.split()[-1]) < 16 and "more than 16 processes" in reason, (out, reason)
    # Polled: confine.cap_tasks in a user namespace of its own; as an unprivileged user (root ignores RLIMIT_NPROC)
    limited = _load_confine(confine_file) + "assert c.cap_tasks(16)\n" + forks
    out = subprocess.run([*_unprivileged(), "unshare", "--user", "--map-root-user", *_python(), "-c", limited],
                         capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0 and int(out.stdout.split()[-1]) < 16, out.stdout + out.stderr


@pytest.fixture
def confine_file():
    """confine.py where the unprivileged user can read it: in place, or (a private checkout: a 0700 home, as on
    cloud GPU nodes) a copy in a fresh folder of the system's temp dir, removed after the test. The same test of
    readability the isolation level unprivileged-user makes (labkit.course.grading.unprivileged.reachable)."""
    if os.geteuid() == 0 and not Path("/usr/bin/python3").exists():
        pytest.skip("no /usr/bin/python3 for the unprivileged user to run")
    if os.geteuid() != 0 or unprivileged.reachable(confine.__file__, NOBODY):
        yield confine.__file__
        return
    folder = Path(tempfile.mkdtemp(prefix="labkit-confine-"))
    try:
        os.chmod(folder, 0o755)
        copy = shutil.copy(confine.__file__, folder / "confine.py")
        os.chmod(copy, 0o644)
        yield str(copy)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _load_confine(path: str) -> str:
    """Code that imports labkit.course.grading.confine (stdlib only) from `path` as `c` without labkit's
    dependencies."""
    return ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('c', {path!r})\n"
            "c = importlib.util.module_from_spec(spec); sys.modules['c'] = c; spec.loader.exec_module(c)\n")


def _unprivileged() -> list[str]:
    """A prefix running a command as uid 65534 when this test runs as root (nothing otherwise)."""
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []


def _python() -> list[str]:
    """A Python the unprivileged user can run (this venv's may sit in root's home)."""
    return ["/usr/bin/python3"] if os.geteuid() == 0 else [sys.executable]


def test_this_machine_says_what_it_allows_as_root_and_not(confine_file):
    conf = confine.detect()
    assert conf.describe().startswith(f"limits per submission: {conf.kind}")
    if conf.kind == confine.POLLED:
        assert conf.detail  # why there is no cgroup
    if os.geteuid() == 0:  # an unprivileged grader on this machine: what it would get, and why
        out = subprocess.run([*_unprivileged(), *_python(), "-c", _load_confine(confine_file) + "print(c.detect().describe())"],
                             capture_output=True, text=True, timeout=60, cwd="/")
        assert out.returncode == 0, out.stderr
        described = out.stdout.strip()
        assert described.startswith("limits per submission: ") and ("uid 65534" in described or "delegated"
                                                                     in described), described


# ---------------------------------------------------------------- nothing outlives a killed grader
def _lab01(extra: str | None = None, exercise: str | None = None):
    """Lab 01's parameters cell, then `extra`; the model_state_bytes cell replaced by `exercise` (with its
    check cell), the other exercise left out."""
    src = nbformat.read(ROOT / "notebooks" / "01_memory.ipynb", 4)
    keep = []
    for i, cell in enumerate(src.cells):
        if "parameters" in cell.metadata.get("tags", []):
            keep += [cell] + ([new_code_cell(extra)] if extra else [])
        elif exercise and exercise_id(cell) == "model_state_bytes":
            cell.source = exercise
            keep += [cell, src.cells[i + 1]]
    src.cells = keep
    return src


HANGS = ("# EXERCISE model_state_bytes: hangs on two ranks\n"
         "def _sleep(rank, world):\n    import time\n    time.sleep(3600)\n\n"
         "def model_state_bytes(params, precision='mixed-bf16', optimizer='adamw', zero_stage=0, dp=1):\n"
         "    from labkit.course.exercises.spawn import spawn\n"
         "    spawn(_sleep, world=2, timeout=3600)\n")


def _start(tmp_path: Path, name: str, nb, *args: str) -> subprocess.Popen:
    path = tmp_path / name / "subs" / "ann" / "01_memory.ipynb"
    path.parent.mkdir(parents=True)
    nbformat.write(nb, path)
    cmd = [str(Path(sys.executable).with_name("labkit")), *args]
    cmd = [a.replace("SUBS", str(path.parents[1])).replace("NB", str(path)).replace("OUT", str(tmp_path / name / "out"))
           for a in cmd]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _wait_for(condition, what, timeout_s: float = 600.0):
    """Wait until `condition()`; `what` (a text, or a function giving one) says what was awaited."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what() if callable(what) else what} after {timeout_s:g} s"
        time.sleep(0.2)


def test_no_process_outlives_a_killed_grader(tmp_path):
    """SIGTERM or SIGKILL to three graders while their sandboxes run: `labkit grade --execute` (executor and
    kernel), `labkit grade` (the exercise's sandboxed process) and `labkit check` (plain, two ranks spawned by
    the student's code: the path of tests/test_exercises_ci.py). Every descendant dies. Without the guard's
    parent-death signal the `labkit check` one's exercise process and ranks outlive it (seen: this test fails)."""
    graders = {
        "kernel": (_start(tmp_path, "kernel", _lab01("import time\nwhile True:\n    time.sleep(1)"),
                          "grade", "SUBS", "--out", "OUT", "--execute", "--timeout", "3600"), "ipykernel"),
        "judge": (_start(tmp_path, "judge", _lab01(exercise=HANGS), "grade", "SUBS", "--out", "OUT"), "_rank"),
        "check": (_start(tmp_path, "check", _lab01(exercise=HANGS), "check", "NB"), "_rank"),
    }
    seen: dict[str, list[psutil.Process]] = {}

    def running(name: str) -> bool:
        grader, marker = graders[name]
        assert grader.poll() is None, f"the {name} grader ended before its sandbox was up"
        seen[name] = _tree(grader.pid)
        return sum(marker in command_line(p) for p in _alive(seen[name])) >= (2 if marker == "_rank" else 1)

    for name in graders:
        _wait_for(lambda: running(name), f"the {name} grader's sandbox")
    for name, (grader, _) in graders.items():
        grader.send_signal(signal.SIGKILL if name == "judge" else signal.SIGTERM)  # no handler runs either way
        grader.wait(timeout=60)
    everyone = [p for procs in seen.values() for p in procs]
    assert len(everyone) >= 6
    _wait_for(lambda: not _alive(everyone),
              lambda: f"every sandboxed process to die; alive: {[command_line(p)[:200] for p in _alive(everyone)]}",
              timeout_s=120)
