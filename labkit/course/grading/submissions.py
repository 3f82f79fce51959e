"""What a batch grades: the students' folders of a submissions directory, read without trusting the file system.

`find_submissions` lists `SUBMISSIONS_DIR/<student>/<notebook>.ipynb` with lstat only (nothing is opened or
followed); what is not a real folder of regular files becomes a Submission with a `problem`, graded as an
`invalid` row with that reason (labkit.course.grading.batch).
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from labkit.errors import GradingError


@dataclass(frozen=True)
class Submission:
    student: str
    notebook: str
    path: Path | None
    """None when the student has no such file."""
    present: tuple[str, ...] = ()
    """The .ipynb files the student's directory does hold (named in the reason when `path` is None)."""
    problem: str = ""
    """Why this submission is `invalid` before anything is read (a linked folder, a file that is no file)."""
    missing: bool = False
    """A rostered student who handed in no such notebook: a `missing` row, 0 points, "not submitted"."""
    file_name: str = ""
    """The student's file name in OUT_DIR (executed/, logs/), unique in the batch (gradebook.file_names)."""


def _entries(folder: Path) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of every entry of `folder` not starting with '.': links are not followed, nothing is opened."""
    out = []
    with os.scandir(folder) as it:
        for entry in it:
            if entry.name.startswith("."):
                continue
            try:
                out.append((entry.name, entry.stat(follow_symlinks=False)))
            except OSError:
                continue  # vanished since listed
    return sorted(out)


def find_submissions(root: str | Path, notebook: str | None = None) -> list[Submission]:
    """One Submission per `<student>/<notebook>.ipynb` (or per student when `notebook` is given).

    Only what lstat says is a folder is a student: a symbolic link to a folder (another student's work, anyone's)
    gets a row of its own marked `invalid`, and is never entered. Every `*.ipynb` entry of a student's folder is a
    submission whatever its type: a FIFO, device or link named like a notebook is refused when read
    (evaluate.read_submitted), as a row with its reason."""
    root = Path(root)
    if not root.is_dir():
        raise GradingError(f"submissions directory {root} does not exist; expected "
                           f"{root}/<student>/<notebook>.ipynb")
    subs = []
    for student, st in _entries(root):
        if stat.S_ISLNK(st.st_mode) and (root / student).is_dir():
            subs.append(Submission(student, notebook or "", None, problem=(
                f"the folder {student} is a symbolic link to another folder, not the student's own; a submission "
                "is a real folder of real files (copy the work in, never link it)")))
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue
        try:
            files = [name for name, _ in _entries(root / student) if name.endswith(".ipynb")]
        except OSError as exc:
            subs.append(Submission(student, notebook or "", None, problem=f"cannot list the folder: {exc.strerror}"))
            continue
        if notebook is not None:
            path = root / student / f"{notebook}.ipynb"
            subs.append(Submission(student, notebook, path if f"{notebook}.ipynb" in files else None, tuple(files)))
            continue
        subs += [Submission(student, name[:-len(".ipynb")], root / student / name) for name in files] or \
            [Submission(student, "", None)]
    return subs


def with_roster(subs: list[Submission], roster, notebook: str | None) -> tuple[list[Submission], list[str]]:
    """`subs` completed by the roster (labkit.course.grading.roster): a `missing` Submission for every rostered
    student and graded notebook they did not hand in; and the folders on no roster line (still graded)."""
    from labkit.course.grading.registry import checks_for

    def course(nb: str) -> bool:
        try:
            return bool(nb) and checks_for(nb) is not None
        except GradingError:
            return False

    notebooks = [notebook] if notebook else sorted({s.notebook for s in subs if course(s.notebook)}) or [""]
    by_folder: dict[str, list[Submission]] = {}
    for sub in subs:
        by_folder.setdefault(sub.student, []).append(sub)
    out, unrostered, claimed = [], [], set()
    for folder, own in by_folder.items():
        student = roster.find(folder)
        if student is None:
            unrostered.append(folder)
            out += own
            continue
        claimed.add(student.id)
        handed = {s.notebook for s in own}
        out += [s for s in own if s.notebook or s.problem] + [
            Submission(folder, nb, None, missing=True) for nb in notebooks if nb not in handed and not
            any(s.problem for s in own)]
    for student in roster.students:
        if student.id not in claimed:
            out += [Submission(student.id, nb, None, missing=True) for nb in notebooks]
    return sorted(out, key=lambda s: (s.student, s.notebook)), sorted(unrostered)
