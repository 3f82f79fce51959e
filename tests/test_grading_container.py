"""Gradescope's container, rehearsed (issue #37 item 1): `run_autograder` as root under Docker's default seccomp
profile and capabilities (tests/_container.py: unshare, setns and clone with namespace flags -> EPERM, clone3 ->
ENOSYS, no CAP_SYS_ADMIN), where neither bubblewrap nor `unshare` can start.

labkit falls back to the isolation level `unprivileged-user` (labkit.course.grading.unprivileged): the student's
kernel and exercise processes run as an unprivileged user, the hidden tests readable by root only. Four
submissions of lab 01, re-executed in the sandbox (`execute` on) but the unattempted one:
- honest: the solution notebook scores what it scores unconfined, full marks (test_grading_hostile's
  `honest_full`, there under bubblewrap or a mount namespace);
- unattempted: the notebook as released, unexecuted, graded as lab 01's zip does by default (no `execute`:
  recorded checks and the code tests, in the exercise's sandboxed process), scores 0;
- tricks: the hostile corpus's four tampering tricks in one notebook (runner replaced in the kernel,
  always-equal answers, the calling test's locals, a forged report on every descriptor): nothing extra;
- loot: the kernel and the exercise's process try to read the hidden tests (in /autograder/source and in the
  checkout) and write what they found where the student sees it: "Permission denied", no hidden text anywhere.
The autograder's root is world-traversable, its files unpacked with the zip's modes (0644), as on Gradescope:
what keeps the hidden tests out of reach is run_autograder's own `seal`.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

from labkit.course.exercises.release import released_notebook
from labkit.course.grading import gradescope, isolation, unprivileged

pytestmark = pytest.mark.slow  # run_autograder processes, their kernels and exercise processes

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = "01_memory"
HIDDEN = ROOT / "notebooks" / "tests" / "hidden" / f"{NOTEBOOK}.py"
_spec = importlib.util.spec_from_file_location("grading_hostile", Path(__file__).parent / "test_grading_hostile.py")
_hostile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_hostile)  # its lab-01 submission builders and the hidden tests' markers


def _cannot_rehearse() -> str | None:
    """Why this machine cannot rehearse the container (one line), else None."""
    if os.geteuid() != 0:
        return "the rehearsal starts run_autograder as root, as Gradescope does; run as root to include it"
    if not (shutil.which("unshare") and shutil.which("setpriv")):
        return "needs util-linux's unshare and setpriv"
    if unprivileged.sandbox_user() is None:
        return f"no sandbox user ({', '.join(unprivileged.SANDBOX_USERS)}) on this machine"
    try:
        import pyseccomp  # noqa: F401 - loads Debian's libseccomp2
    except (ImportError, OSError) as exc:
        return f"pyseccomp over libseccomp2 unavailable ({exc}); `apt-get install libseccomp2`, the test extra"
    return None


pytestmark = [pytestmark, pytest.mark.skipif(_cannot_rehearse() is not None, reason=str(_cannot_rehearse()))]

#: Reads the hidden tests where they are on Gradescope and in a checkout; "LOOT <path>: <text or error>; ...".
LOOT = textwrap.dedent('''
    def _loot():
        found = []
        for path in {paths!r}:
            try:
                found.append(path + ": " + open(path).read())
            except OSError as exc:
                found.append(path + ": " + exc.strerror)
        return "LOOT " + "; ".join(found)
''')


def _submissions(root: Path) -> dict:
    source = nbformat.read(ROOT / "notebooks" / f"{NOTEBOOK}.ipynb", 4)
    loot = LOOT.format(paths=[str(root / "loot" / "source" / "autograder" / f"{NOTEBOOK}.py"), str(HIDDEN)])
    cells = {"model_state_bytes": f"# EXERCISE model_state_bytes: attacked\n{loot}\n{_hostile.MSB}"
                                  "    raise AssertionError(_loot()[:20000])\n"}
    # the kernel's loot stops the notebook: the row's detail (in results.json) quotes the cell's error
    return {"honest": source, "unattempted": released_notebook(ROOT / "notebooks" / f"{NOTEBOOK}.ipynb"),
            "tricks": _hostile._all_tricks(), "loot": _hostile._submission(cells, loot + "\nraise RuntimeError(_loot())")}


def _unpack(base: Path, zip_path: Path, name: str, nb) -> Path:
    """A Gradescope-like root: source/ with the zip's modes, run_autograder, the submission (world-readable)."""
    root = base / name
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(root / "source")
        for info in zf.infolist():
            os.chmod(root / "source" / info.filename, (info.external_attr >> 16) & 0o777)
    for folder in [root, *(p for p in (root / "source").rglob("*") if p.is_dir())]:
        os.chmod(folder, 0o755)
    config = root / "source" / gradescope.CONFIG
    config.write_text(json.dumps({**json.loads(config.read_text()), "execute": name != "unattempted"}))
    shutil.copy2(root / "source" / "run_autograder", root / "run_autograder")
    (root / "submission").mkdir(mode=0o755)
    nbformat.write(nb, root / "submission" / f"{NOTEBOOK}.ipynb")
    (root / "submission_metadata.json").write_text(json.dumps({"users": [{"email": f"{name}@example.edu"}]}))
    return root


def _container(*argv: str) -> list[str]:
    """`argv` run in the rehearsed container (tests/_container.py), the checkout reduced to the installed labkit."""
    shown = [*isolation.runtime_paths("labkit"), ROOT / "requirements"]
    return ["unshare", "--mount", "--propagation", "private", "--", sys.executable, str(ROOT / "tests" / "_container.py"),
            *[f"--show={p}" for p in shown], f"--cover={ROOT}", "--", *argv]


def _in_container(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, gradescope.ROOT_ENV: str(root), "LABKIT_AUTOGRADER_PYTHON": sys.executable}
    return subprocess.run(_container(str(root / "run_autograder")), cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory):
    """{submission: (results.json, the autograder's stdout)} after run_autograder in the rehearsed container."""
    zips = tmp_path_factory.mktemp("container-zip")
    zip_path = gradescope.write_zip(zips / f"{NOTEBOOK}.zip", NOTEBOOK, HIDDEN, HIDDEN.parent.parent / HIDDEN.name,
                                    gradescope.Settings(NOTEBOOK, execute=True))
    base = Path(tempfile.mkdtemp(prefix="labkit-gs-rehearsal-"))  # world-traversable, as /autograder
    os.chmod(base, 0o755)
    try:
        roots = {name: _unpack(base, zip_path, name, nb) for name, nb in _submissions(base).items()}
        with ThreadPoolExecutor(2) as pool:  # two containers at a time, as two Gradescope submissions
            runs = dict(zip(roots, pool.map(_in_container, roots.values())))
        out = {}
        for name, run in runs.items():
            assert run.returncode == 0, f"{name}: {run.stdout[-2000:]}\n{run.stderr[-3000:]}"
            out[name] = (json.loads((roots[name] / "results" / "results.json").read_text()), run.stdout)
        yield out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_container_refuses_namespaces_and_labkit_names_the_level_it_falls_back_to(rehearsed):
    for name, (results, stdout) in rehearsed.items():
        assert results["extra_data"]["isolation"] == unprivileged.LEVEL, (name, stdout)
        assert results["extra_data"]["network_isolated"] is False, name  # said, not hidden: no namespace cuts it
        line = next(x for x in stdout.splitlines() if x.startswith("isolation: "))
        assert "bubblewrap failed" in line and "unshare failed" in line and "network NOT cut" in line, line


def test_honest_work_scores_as_unconfined_and_unattempted_or_tampered_work_nothing(rehearsed):
    honest, unattempted, tricks = (rehearsed[n][0] for n in ("honest", "unattempted", "tricks"))
    assert honest["extra_data"]["status"] == "graded", honest["output"]
    assert honest["score"] == 25 and sum(t["max_score"] for t in honest["tests"]) == 25, honest["output"]
    assert unattempted["score"] == 0, unattempted["output"]
    # the tricks earn no code test (test_grading_hostile's `all_tricks` unconfined: 0/12 and 0/6); the notebook
    # cells that ran before its last cell killed the kernel keep their recorded checks' partial credit, as there
    code = [t for t in tricks["tests"] if t["name"].startswith(("model_state_bytes:", "measure_state_bytes:"))]
    assert len(code) > 2 and all(t["score"] == 0 for t in code), tricks["output"]
    assert "code: model_state_bytes 0/12; measure_state_bytes 0/6" in tricks["output"], tricks["output"]
    assert "FORGED" not in json.dumps(tricks)


def test_the_students_code_cannot_read_a_hidden_test(rehearsed):
    results, stdout = rehearsed["loot"]
    assert results["score"] == 0
    said = [t["output"] for t in results["tests"] if t["visibility"] == "visible" and "LOOT" in t["output"]]
    assert said, results  # the exercise's process ran the loot and its message came back
    sealed = f"loot/source/autograder/{NOTEBOOK}.py: Permission denied"  # unpacked 0644, sealed by run_autograder
    assert all(sealed in s and f"{HIDDEN}: No such file or directory" in s for s in said), said
    assert "raised RuntimeError: LOOT" in results["output"] and sealed in results["output"], results["output"]
    for name, (res, out) in rehearsed.items():
        text = json.dumps(res) + out
        assert not [m for m in _hostile.HIDDEN_MARKERS if m in text], name


def test_labkit_grade_execute_falls_back_too_and_first_makes_the_grader_files_its_own(tmp_path):
    """`labkit grade --execute` as root where no namespace can be made (an HPC node without user namespaces, the
    same container): the same level; it refuses, in one line, while the student's user could read the
    submissions, and two sandboxes at once (the same user: they could reach each other's scratch), then grades
    once the submissions are the grader's, --out made 0700 before any sandbox starts."""
    base = Path(tempfile.mkdtemp(prefix="labkit-grade-rehearsal-"))
    os.chmod(base, 0o755)
    try:
        subs, out = base / "subs", base / "out"
        (subs / "ann").mkdir(parents=True)
        os.chmod(subs, 0o755)
        nbformat.write(_hostile._submission({}), subs / "ann" / f"{NOTEBOOK}.ipynb")  # the parameters cell only
        grade = _container(str(Path(sys.executable).with_name("labkit")), "grade", str(subs), "--out", str(out),
                           "--execute", "--notebook", NOTEBOOK, "--timeout", "300")
        refused = subprocess.run(grade, capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-2000:]
        assert f"can read {subs}" in refused.stderr and f"chmod go-rwx '{subs}'" in refused.stderr, refused.stderr
        os.chmod(subs, 0o700)
        crowded = subprocess.run([*grade, "--workers", "2"], capture_output=True, text=True, timeout=300)
        assert crowded.returncode == 2 and "use --workers 1" in crowded.stderr, crowded.stderr[-2000:]
        graded = subprocess.run(grade, capture_output=True, text=True, timeout=600)
        assert graded.returncode == 0, graded.stdout[-2000:] + graded.stderr[-2000:]
        assert f"isolation: {unprivileged.LEVEL} (runs as " in graded.stdout
        assert (out / "grades.csv").is_file() and (out.stat().st_mode & 0o777) == 0o700
    finally:
        shutil.rmtree(base, ignore_errors=True)
