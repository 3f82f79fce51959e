"""Gradescope autograder zip (issue #28 part 1): built by `labkit assign --gradescope`, unpacked into a
temporary root laid out like Gradescope's /autograder (LABKIT_AUTOGRADER_ROOT), its setup.sh steps that need
no network run against this venv, then run_autograder on an honest, a wrong and a tampered lab-01 submission;
each results.json is checked against Gradescope's documented format (gradescope.RESULTS_SCHEMA).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema
import nbformat
import pytest
from nbformat.v4 import new_output

from labkit import lockfile
from labkit.cli import main
from labkit.course.grading import gradescope, isolation
from labkit.results import MIME

pytestmark = pytest.mark.slow  # run_autograder processes, and the sandboxed exercise processes they start

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("grading_hostile", Path(__file__).parent / "test_grading_hostile.py")
hostile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hostile)  # its lab-01 submission builders


def _env(root: Path) -> dict:
    return {**os.environ, gradescope.ROOT_ENV: str(root), "LABKIT_AUTOGRADER_PYTHON": sys.executable,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _root(tmp_path: Path, zip_path: Path, name: str, nb) -> Path:
    """A Gradescope-like root: source/ (the zip), run_autograder copied beside it, the submission."""
    root = tmp_path / name
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(root / "source")
        for info in zf.infolist():  # extractall drops the modes Gradescope keeps
            os.chmod(root / "source" / info.filename, (info.external_attr >> 16) & 0o777)
    shutil.copy2(root / "source" / "run_autograder", root / "run_autograder")
    (root / "submission").mkdir()
    nbformat.write(nb, root / "submission" / "01_memory.ipynb")
    (root / "submission_metadata.json").write_text(json.dumps({"users": [{"email": f"{name}@example.edu"}]}))
    return root


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gradescope")
    with pytest.raises(SystemExit) as done:
        main(["assign", "--out", str(tmp / "release"), "--source", str(ROOT / "notebooks"), "--gradescope"])
    assert done.value.code in (0, None)
    zip_path = tmp / "release" / "gradescope" / "01_memory.zip"
    honest = hostile._submission(hostile._source_cells())
    wrong = hostile._submission({"model_state_bytes": "# EXERCISE model_state_bytes: wrong\n"
                                                      + hostile.WRONG["model_state_bytes"].format(result="0")})
    tampered = hostile._submission(hostile._source_cells())
    forged = {"kind": "answer", "key": "01.zero3_7p5b_64gpus_gb", "value": 1.9}  # typed in, no seal
    tampered.cells[0].outputs = [new_output("display_data", data={MIME: forged, "text/plain": "answer"})]
    out = {}
    for name, nb in (("honest", honest), ("wrong", wrong), ("tampered", tampered)):
        root = _root(tmp, zip_path, name, nb)
        run = subprocess.run([str(root / "run_autograder")], cwd=root, env=_env(root), capture_output=True,
                             text=True, timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
        out[name] = (json.loads((root / "results" / "results.json").read_text()), run.stdout)
    return tmp, zip_path, out


def test_the_zip_has_gradescopes_layout_and_pins_labkit_by_the_lock(graded):
    tmp, zip_path, _ = graded
    with zipfile.ZipFile(zip_path) as zf:
        names = set(zf.namelist())
        modes = {i.filename: (i.external_attr >> 16) for i in zf.infolist()}
        settings = json.loads(zf.read(gradescope.CONFIG))
        assert zf.read("requirements/lock.txt") == (ROOT / "requirements" / "lock.txt").read_bytes()
    assert {"setup.sh", "run_autograder", "autograder/01_memory.py", "autograder/visible/01_memory.py",
            "labkit-src/pyproject.toml", "labkit-src/labkit/course/grading/gradescope.py"} <= names
    assert modes["setup.sh"] & stat.S_IXUSR and modes["run_autograder"] & stat.S_IXUSR
    assert not [n for n in names if "__pycache__" in n or n.startswith("notebooks/")]
    assert settings["notebook"] == "01_memory" and settings["hidden_visibility"] == "after_published"
    assert sorted(p.name for p in (tmp / "release" / "gradescope").glob("*.zip")) == \
        sorted(f"{p.stem}.zip" for p in (ROOT / "notebooks").glob("*.ipynb"))


def test_setup_steps_without_network_check_the_install_against_the_lock(graded):
    tmp, zip_path, _ = graded
    root = _root(tmp, zip_path, "setup", hostile._submission({}))
    run = subprocess.run(["bash", str(root / "source" / "setup.sh")], env={**_env(root), "LABKIT_AUTOGRADER_STEPS": "check"},
                         capture_output=True, text=True, timeout=300)
    lock = lockfile.status(ROOT / "requirements" / "lock.txt")
    if lock["matches"]:
        assert run.returncode == 0 and "code exercise(s)" in run.stdout, run.stderr
    else:  # this venv drifted from the lock: setup stops, naming what differs, in one line
        assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
        assert lock["differences"][0] in run.stderr and "Traceback" not in run.stderr


def test_results_json_follows_gradescopes_format_for_honest_wrong_and_tampered(graded):
    _, _, out = graded
    for name, (results, _) in out.items():
        jsonschema.validate(results, gradescope.RESULTS_SCHEMA)
        assert results["execution_time"] > 0 and results["output"].startswith("01_memory: "), name
        assert results["score"] == pytest.approx(sum(t["score"] for t in results["tests"])), name
    honest, wrong, tampered = (out[n][0] for n in ("honest", "wrong", "tampered"))
    code = [t for t in honest["tests"] if t["name"].startswith(("model_state_bytes:", "measure_state_bytes:"))]
    assert code and all(t["status"] == "passed" for t in code)
    assert honest["score"] == 18  # every code test; the recorded checks fail (nothing ran)
    assert wrong["score"] == 0 and [t for t in wrong["tests"] if t["name"].startswith("model_state_bytes:")]
    assert tampered["score"] == 0 and tampered["extra_data"]["status"] == "tampered"
    assert "has no labkit seal" in tampered["tests"][0]["output"]
    for results in (honest, wrong):
        hidden = [t for t in results["tests"] if t["visibility"] != "visible"]
        assert hidden and all(t["visibility"] == "after_published" and t["output"] == "" for t in hidden)
        text = json.dumps(results)
        assert not [m for m in hostile.HIDDEN_MARKERS if m in text]



def test_run_autograder_names_its_isolation_and_seals_the_tests_from_the_students_user(graded):
    """The autograder log and results.json name the level (tests/test_grading_container.py rehearses the one
    Gradescope's Docker leaves: unprivileged-user); as root, source/ and submission/ are then the grader's only."""
    tmp, zip_path, out = graded
    for name, (results, stdout) in out.items():
        level = results["extra_data"]["isolation"]
        assert level in (isolation.BUBBLEWRAP, isolation.MOUNT_NS, isolation.UNPRIVILEGED), (name, level)
        assert f"isolation: {level} (" in stdout and isinstance(results["extra_data"]["network_isolated"], bool)
        if os.geteuid() == 0:
            for folder in ("source", "submission"):
                assert stat.S_IMODE((tmp / name / folder).stat().st_mode) == 0o700, (name, folder)
    with zipfile.ZipFile(zip_path) as zf:
        setup = zf.read("setup.sh").decode()
    assert "useradd --system" in setup and "system venv packages user check" in setup
    assert "UV_PYTHON_INSTALL_DIR=/opt/" in setup  # not root's 0700 home: the student's user runs this Python
