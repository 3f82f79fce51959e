"""Gradescope autograder zips: `labkit assign --out DIR --gradescope` writes DIR/gradescope/<notebook>.zip.

Layout (Gradescope's "Autograder Specifications": the zip's root is extracted to /autograder/source; Gradescope
runs `setup.sh` once when it builds the image, then `run_autograder` in a fresh container per submission, with
the submission in /autograder/submission/ and the results expected in /autograder/results/results.json):

    setup.sh                 the steps that build the grading environment, one shell function each
    run_autograder           `python -m labkit.course.grading.gradescope`: grade, write results.json
    labkit-gradescope.json   the lab's settings (notebook, execute, profile, limits, hidden-test visibility)
    autograder/<nb>.py       the lab's hidden tests, autograder/visible/<nb>.py its visible ones
    requirements/lock.txt    the class's lock (labkit.lockfile): every package installed at its locked version
    labkit-src/              labkit itself (pyproject.toml, README.md, labkit/), installed with the lock

`run_autograder` grades with `labkit grade`'s own code (labkit.course.grading.batch.run_batch: the same
workspace copy, sandbox, checks, code tests and plan), so a Gradescope score equals the `labkit grade` score
of the same file. results.json holds the total `score`, one test per check and per exercise test (`name`,
`score`, `max_score`, `status`, `output`, `visibility`), `execution_time` and the student-facing summary in
`output`. A hidden test is `after_published` (or `hidden`: labkit-gradescope.json) and never carries its
message. The /autograder root is LABKIT_AUTOGRADER_ROOT when set (tests).
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

from labkit.errors import GradingError, LabkitError

CONFIG = "labkit-gradescope.json"
ROOT_ENV = "LABKIT_AUTOGRADER_ROOT"
#: Gradescope's test visibilities (its docs); hidden tests take one of the last two.
VISIBILITIES = ("visible", "after_due_date", "after_published", "hidden")
HIDDEN_VISIBILITIES = ("after_published", "hidden")
#: What results.json must look like (Gradescope's "Output format", the fields labkit writes).
RESULTS_SCHEMA = {
    "type": "object",
    "required": ["score", "tests"],
    "properties": {
        "score": {"type": "number", "minimum": 0},
        "execution_time": {"type": "number", "minimum": 0},
        "output": {"type": "string"},
        "output_format": {"enum": ["text", "html", "simple_format", "md", "ansi"]},
        "visibility": {"enum": list(VISIBILITIES)},
        "stdout_visibility": {"enum": list(VISIBILITIES)},
        "extra_data": {"type": "object"},
        "tests": {"type": "array", "items": {
            "type": "object",
            "required": ["name", "score", "max_score", "visibility"],
            "properties": {
                "score": {"type": "number", "minimum": 0},
                "max_score": {"type": "number", "minimum": 0},
                "status": {"enum": ["passed", "failed"]},
                "name": {"type": "string"},
                "number": {"type": "string"},
                "output": {"type": "string"},
                "output_format": {"enum": ["text", "html", "simple_format", "md", "ansi"]},
                "tags": {"type": "array", "items": {"type": "string"}},
                "visibility": {"enum": list(VISIBILITIES)},
                "extra_data": {"type": "object"},
            },
            "additionalProperties": False,
        }},
    },
}

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this in a fresh container per submission (working directory /autograder): labkit grades
# /autograder/submission/ as `labkit grade` would and writes /autograder/results/results.json.
# LABKIT_AUTOGRADER_ROOT replaces /autograder (tests); LABKIT_AUTOGRADER_PYTHON the venv's Python.
set -u
ROOT="${LABKIT_AUTOGRADER_ROOT:-/autograder}"
PY="${LABKIT_AUTOGRADER_PYTHON:-$ROOT/venv/bin/python}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MPLBACKEND=Agg
exec "$PY" -m labkit.course.grading.gradescope --root "$ROOT"
"""

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder image (network available). Each step is
# a function; LABKIT_AUTOGRADER_STEPS picks some (tests run the ones that need no network: "check").
# Unverified on Gradescope itself (written against its documented layout and Ubuntu base images).
set -euo pipefail
SOURCE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="${LABKIT_AUTOGRADER_ROOT:-/autograder}"
VENV="${LABKIT_AUTOGRADER_VENV:-$ROOT/venv}"
PY="${LABKIT_AUTOGRADER_PYTHON:-$VENV/bin/python}"
LOCK="$SOURCE/requirements/lock.txt"
PYTHON_VERSION="$(sed -n 's/^# python: //p' "$LOCK")"   # the Python the lock was made on

system() {  # the sandbox each student's code runs in (docs/grading.md, "On Gradescope"): bubblewrap where the
    # container allows namespaces; else (Docker's default seccomp profile) setpriv runs it as labkit-student
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends bubblewrap ca-certificates curl util-linux
}

venv() {  # the lock's Python (uv fetches it whatever the image's python3 is), then an empty venv. The Python
    # goes to /opt, not root's home (0700): the student's user must be able to run it
    curl -LsSf https://astral.sh/uv/install.sh | env UV_INSTALL_DIR=/usr/local/bin sh
    UV_PYTHON_INSTALL_DIR=/opt/labkit-python uv venv --python "$PYTHON_VERSION" --seed "$VENV"
}

user() {  # the unprivileged user the student's code runs as where bubblewrap cannot start; it reads the Python
    # and labkit, never the hidden tests (run_autograder makes source/ and submission/ root-only again)
    id -u labkit-student >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin labkit-student
    chmod -R go+rX "$VENV" /opt/labkit-python
    chmod 0700 "$SOURCE"
}

packages() {  # the locked torch as a CPU build (grading needs no GPU), then labkit and its locked deps
    local torch vision
    torch="$(sed -n 's/^torch==//p' "$LOCK")"; vision="$(sed -n 's/^torchvision==//p' "$LOCK")"
    "$PY" -m pip install -c "$LOCK" --index-url https://download.pytorch.org/whl/cpu \\
        --extra-index-url https://pypi.org/simple "torch==$torch" "torchvision==$vision"
    "$PY" -m pip install -c "$LOCK" "$SOURCE/labkit-src"
    "$PY" -m ipykernel install --sys-prefix --name labkit --display-name "labkit (Python 3)"
}

check() {  # no network: labkit imports, the environment matches the lock, the lab's tests load
    "$PY" -m labkit.course.grading.gradescope --root "$ROOT" --check
}

for step in ${LABKIT_AUTOGRADER_STEPS:-system venv packages user check}; do
    echo "setup.sh: $step"
    "$step"
done
"""


@dataclass(frozen=True)
class Settings:
    """labkit-gradescope.json: how run_autograder grades one lab."""

    notebook: str
    execute: bool = False
    """Re-run the notebook in the sandbox first (the notebook's metadata.labkit.gradescope_execute)."""
    profile: str = "smoke"
    timeout_s: float = 600.0
    exercise_timeout_s: float = 300.0
    memory_gib: float = 8.0
    """Memory cap of one submission (labkit grade's default): each process's address space (RLIMIT_AS) and the
    whole tree's memory. At 4 a lab-01 kernel could not even import transformers' Llama (torch maps ~5 GiB)."""
    hidden_visibility: str = "after_published"
    """Gradescope visibility of hidden tests (their name and score; never their message)."""
    unsafe_no_isolation: bool = False
    """Grade even where the container allows no sandbox (the student's code could read the hidden tests)."""

    def __post_init__(self) -> None:
        if self.hidden_visibility not in HIDDEN_VISIBILITIES:
            raise GradingError(f"{CONFIG}: hidden_visibility={self.hidden_visibility!r}; give one of "
                               f"{', '.join(HIDDEN_VISIBILITIES)}")


def _labkit_source() -> Path:
    from labkit.course import source_tree

    tree = source_tree()
    if not (tree / "pyproject.toml").is_file():
        raise GradingError(f"labkit at {tree} is not a source tree (no pyproject.toml); run `labkit assign "
                           "--gradescope` from a checkout of the course repository")
    return tree


def _lock_file(tree: Path) -> Path:
    from labkit.lockfile import LOCK_PATH

    lock = tree / LOCK_PATH
    if not lock.is_file():
        raise GradingError(f"no {lock}: run `make lock` first (the zip installs labkit with the class's lock)")
    return lock


def _add(zf: zipfile.ZipFile, name: str, data: bytes, executable: bool = False) -> None:
    info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))  # fixed time: the same inputs, the same zip
    info.external_attr = ((0o755 if executable else 0o644) | stat.S_IFREG) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    zf.writestr(info, data)


def _tree_files(folder: Path):
    for path in sorted(folder.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            yield path


def write_zip(out: Path, notebook: str, hidden: Path | None, visible: Path | None, settings: Settings) -> Path:
    """DIR/gradescope/<notebook>.zip for one lab (see the module docstring)."""
    tree = _labkit_source()
    lock = _lock_file(tree)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    with zipfile.ZipFile(tmp, "w") as zf:
        _add(zf, "setup.sh", SETUP_SH.encode(), executable=True)
        _add(zf, "run_autograder", RUN_AUTOGRADER.encode(), executable=True)
        _add(zf, CONFIG, (json.dumps(settings.__dict__, indent=2) + "\n").encode())
        for src, name in ((hidden, f"autograder/{notebook}.py"), (visible, f"autograder/visible/{notebook}.py")):
            if src is not None and src.is_file():
                _add(zf, name, src.read_bytes())
        _add(zf, "requirements/lock.txt", lock.read_bytes())
        for name in ("pyproject.toml", "README.md"):
            _add(zf, f"labkit-src/{name}", (tree / name).read_bytes())
        for path in _tree_files(tree / "labkit"):
            _add(zf, f"labkit-src/{path.relative_to(tree).as_posix()}", path.read_bytes())
    tmp.replace(out)
    return out


def write_zips(release, out_dir: str | Path, source_dir: str | Path) -> list[Path]:
    """One zip per released notebook (labkit.course.exercises.release.Release) in OUT/gradescope/."""
    import nbformat

    out, source = Path(out_dir), Path(source_dir)
    zips = []
    for path in release.notebooks:
        nb = nbformat.read(source / path.name, as_version=4)
        meta = nb.metadata.get("labkit") or {}
        name = meta.get("notebook") or path.stem
        settings = Settings(name, execute=bool(meta.get("gradescope_execute", False)))
        zips.append(write_zip(out / "gradescope" / f"{name}.zip", name, out / "autograder" / f"{name}.py",
                              out / "autograder" / "visible" / f"{name}.py", settings))
    return zips


# ----------------------------------------------------------------------------------------- run_autograder


def load_settings(source: Path) -> Settings:
    try:
        return Settings(**json.loads((source / CONFIG).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as exc:
        raise GradingError(f"{source / CONFIG} unreadable ({exc}); rebuild the zip with `labkit assign "
                           "--gradescope`") from exc


def _student(root: Path) -> str:
    """The submitter's email (Gradescope's submission_metadata.json), else 'submission'."""
    try:
        users = json.loads((root / "submission_metadata.json").read_text(encoding="utf-8")).get("users") or []
        return str(users[0].get("email") or users[0].get("name") or "submission")
    except (OSError, ValueError, AttributeError, IndexError, TypeError):
        return "submission"


def _pick(submission: Path, notebook: str) -> tuple[Path | None, str]:
    """The submitted notebook: <notebook>.ipynb, else the only .ipynb; (None, why) otherwise."""
    exact = submission / f"{notebook}.ipynb"
    if exact.is_file():
        return exact, ""
    found = sorted(p for p in submission.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    if len(found) == 1:
        return found[0], ""
    if not found:
        return None, f"no notebook in the submission; upload your executed {notebook}.ipynb"
    names = ", ".join(p.name for p in found[:5])
    return None, f"{len(found)} notebooks in the submission ({names}); upload only {notebook}.ipynb"


def results_json(row, settings: Settings, elapsed_s: float, extra: dict | None = None) -> dict:
    """Gradescope's results.json for one gradebook row (labkit.course.grading.evaluate.Grade)."""
    from labkit.course.grading.evaluate import GRADED
    from labkit.course.grading.text import clean

    tests = []
    for r in row.results:
        visible = bool(r.visible)
        tests.append({"name": clean(r.name, 300), "score": float(r.earned), "max_score": float(r.points),
                      "status": "passed" if r.passed else "failed",
                      "output": clean(r.message) if visible else "",
                      "visibility": "visible" if visible else settings.hidden_visibility})
    if row.status != GRADED and not tests:  # invalid / tampered: nothing ran, the reason is the one test
        tests.append({"name": f"{row.notebook}: {row.status}", "score": 0.0, "max_score": float(row.max_score),
                      "status": "failed", "output": clean(row.detail), "visibility": "visible"})
    summary = f"{row.notebook}: {row.score:g} / {row.max_score:g} ({row.status}). {clean(row.detail)}"
    if any(t["visibility"] != "visible" for t in tests):
        summary += ("\nHidden tests are listed with their score when grades are published; their messages are "
                    "never shown.")
    return {"score": float(row.score), "execution_time": round(elapsed_s, 1), "output": summary,
            "output_format": "text", "stdout_visibility": "hidden", "tests": tests,
            "extra_data": {"status": row.status, **(extra or {})}}


def _failed(settings: Settings, student: str, reason: str):
    """The row of a submission the autograder could not grade (its environment, not the student's work)."""
    from labkit.course.grading.evaluate import ERROR, Grade

    return Grade(student, settings.notebook, ERROR, 0.0, 0.0,
                 f"the autograder could not grade this submission ({reason}); your instructor has been told")


def seal(root: Path) -> None:
    """As root: the zip's files (the hidden tests), the submission and its metadata readable by root only, so
    that the student's user cannot read them (isolation level unprivileged-user; harmless under the others)."""
    if os.geteuid() != 0:
        return
    for path in (root / "source", root / "submission", root / "submission_metadata.json", root / "results"):
        try:
            os.chmod(path, 0o700 if path.is_dir() else 0o600)
        except OSError:
            pass  # absent: nothing to hide


def grade(root: Path) -> tuple[dict, str | None]:
    """Grade root/submission/ with labkit grade's code; write root/results/results.json. Returns it and, when
    the autograder itself could not grade (no sandbox, a broken zip), the problem for the instructor."""
    from labkit.course.grading.batch import GradeOptions, isolation_for, run_batch
    from labkit.course.grading.sandbox import Limits
    from labkit.errors import LabkitError

    start = time.monotonic()
    seal(root)
    source = root / "source"
    student, problem, extra = _student(root), None, {}
    try:
        settings = load_settings(source)
    except LabkitError as exc:
        settings, problem = Settings("notebook"), str(exc)
    if problem is None:
        limits = Limits(timeout_s=settings.timeout_s, memory_bytes=int(settings.memory_gib * 2**30))
        opts = GradeOptions(execute=settings.execute, notebook=settings.notebook, profile=settings.profile,
                            limits=limits, autograder=str(source / "autograder"),
                            private=(str(source), str(root / "submission")),
                            unsafe_no_isolation=settings.unsafe_no_isolation,
                            exercise_timeout_s=settings.exercise_timeout_s)
        picked, why = _pick(root / "submission", settings.notebook)
        try:
            iso = isolation_for(opts)  # none, and not accepted in labkit-gradescope.json: the instructor's problem
            print(f"isolation: {iso.level} ({iso.detail})", flush=True)
            extra.update(isolation=iso.level, network_isolated=iso.network_isolated)
            with tempfile.TemporaryDirectory(prefix="labkit-gs-") as tmp:
                subs = Path(tmp) / "subs"
                (subs / student).mkdir(parents=True)
                if picked is not None:
                    shutil.copyfile(picked, subs / student / f"{settings.notebook}.ipynb")
                row = run_batch(subs, Path(tmp) / "out", opts).rows[0]
            if picked is None:  # run_batch's own row (invalid, 0 of the plan's points), with the reason here
                row = replace(row, detail=why)
        except LabkitError as exc:
            problem = str(exc)
    if problem is not None:
        row = _failed(settings, student, "see the autograder output")
    print(f"{row.status}  {row.score:g}/{row.max_score:g}  {row.detail}", flush=True)  # the instructor's stdout
    results = results_json(row, settings, time.monotonic() - start, extra)
    out = root / "results" / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results, problem


def check(root: Path) -> str:
    """setup.sh's last step: labkit imports, the environment matches the lock, the lab's plan loads."""
    from labkit import lockfile
    from labkit.course.exercises.grading import plan_for_autograder

    source = root / "source"
    settings = load_settings(source)
    plan = plan_for_autograder(settings.notebook, source / "autograder")
    lock = lockfile.status(source / "requirements" / "lock.txt")
    if not lock["matches"]:
        raise GradingError("the environment differs from the class's lock: " + "; ".join(lock["differences"][:5])
                           + "; rebuild the autograder image (setup.sh installs with the lock)")
    return (f"labkit grades {settings.notebook}: {len(plan.exercises)} code exercise(s) ({plan.max_score:g} points "
            f"of code tests); the environment matches the lock")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m labkit.course.grading.gradescope", description=__doc__)
    parser.add_argument("--root", default=os.environ.get(ROOT_ENV, "/autograder"))
    parser.add_argument("--check", action="store_true", help="check the installation (setup.sh), grade nothing")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if not args.check:
        results, problem = grade(root)
        if problem is not None:  # results.json says so to the student; this line is for the instructor
            print(f"error: {problem}", file=sys.stderr)
            return 2
        print(f"score {results['score']:g} (results.json written)")
        return 0
    try:
        print(check(root))
    except LabkitError as exc:  # a broken zip or environment: one line for the instructor, never a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
