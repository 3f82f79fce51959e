"""Grade one executed notebook on its recorded results: read it safely, check identity and seals, run checks.

Used by `labkit check` (visible checks, integrity problems shown as things to fix) and by `labkit grade`
(every check; any integrity problem makes the row `tampered`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from labkit.errors import GradingError
from labkit.course.grading import tamper
from labkit.course.grading.checks import Check, CheckResult
from labkit.course.grading.evidence import IDENTITY_KEY, Evidence, identity

GRADED, ERROR, TIMEOUT, INVALID, TAMPERED = "graded", "error", "timeout", "invalid", "tampered"
#: A notebook executed as a rehearsal (labkit.rehearsal): stand-in models on CPU, nothing measured.
REHEARSAL = "rehearsal"
STATUSES = (GRADED, ERROR, TIMEOUT, INVALID, TAMPERED, REHEARSAL)
#: Largest submitted notebook read into memory (a few figures make a course notebook ~1-5 MB).
DEFAULT_MAX_BYTES = 50 * 2**20


class SubmissionProblem(GradingError):
    """A submission that gets a non-graded status; the message is the row's reason."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Grade:
    """One row of the gradebook (grades.csv) plus the per-check results behind it."""

    student: str
    notebook: str
    status: str
    score: float
    max_score: float
    detail: str
    results: tuple[CheckResult, ...] = ()
    digests: tuple[str, ...] = ()
    """Seal digests of the submitted notebook's results (a copy of the same file shares them)."""
    signatures: tuple[str, ...] = ()
    """Digests of the measured values of its recorded runs (labkit.course.grading.copies: a copy shares them)."""
    review: str = ""
    """A note for the instructor (grades.csv, never the student's feedback): e.g. runs identical to another's."""


def load_notebook(path: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_BYTES):
    """The nbformat v4 node of `path`; SubmissionProblem('invalid') for anything that is not one.

    The size is checked before a byte is read, so a 10 GB file costs nothing.
    """
    import nbformat

    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise SubmissionProblem(INVALID, f"cannot read {path.name}: {exc.strerror}") from exc
    if size > max_bytes:
        raise SubmissionProblem(INVALID, f"{path.name} is {size / 2**20:.1f} MiB, above the "
                                f"{max_bytes / 2**20:.0f} MiB cap; clear huge outputs and save again")
    try:
        text = path.read_bytes().decode("utf-8")
        data = json.loads(text)
    except UnicodeDecodeError as exc:
        raise SubmissionProblem(INVALID, f"{path.name} is not UTF-8 text ({exc.reason})") from exc
    except json.JSONDecodeError as exc:
        raise SubmissionProblem(INVALID, f"{path.name} is not valid JSON (line {exc.lineno}, column "
                                f"{exc.colno}: {exc.msg}); download the notebook again from Jupyter") from exc
    except RecursionError as exc:
        raise SubmissionProblem(INVALID, f"{path.name} nests JSON too deeply to be a notebook") from exc
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise SubmissionProblem(INVALID, f"{path.name} is JSON but not a Jupyter notebook (no 'cells' list)")
    if data.get("nbformat") != 4:
        raise SubmissionProblem(INVALID, f"{path.name} has nbformat {data.get('nbformat')!r}, not 4; open and "
                                f"save it in a current Jupyter")
    try:
        nb = nbformat.reads(text, as_version=4, capture_validation_error={})
        for cell in nb.cells:  # touch what grading relies on, so a malformed cell fails here
            if not isinstance(cell.get("source", ""), str) or not isinstance(cell.get("outputs", []), list):
                raise ValueError("a cell has a malformed source or outputs")
    except Exception as exc:  # noqa: BLE001 - nbformat raises many types on malformed input
        raise SubmissionProblem(INVALID, f"{path.name} is not a valid notebook ({type(exc).__name__}: "
                                f"{str(exc)[:200]})") from exc
    return nb


def check_identity(nb, expected: str) -> None:
    """SubmissionProblem('invalid') unless the notebook says it is course notebook `expected`."""
    found = identity(nb)
    key = ".".join(("metadata",) + IDENTITY_KEY)
    if found is None:
        raise SubmissionProblem(INVALID, f"no {key} in the notebook, so it is not a course notebook; "
                                f"submit your copy of {expected}.ipynb")
    if found != expected:
        raise SubmissionProblem(INVALID, f"wrong notebook: this is {found!r} ({key}), expected {expected!r}")


def run_checks(nb, notebook: str, checks: Sequence[Check]) -> tuple[CheckResult, ...]:
    evidence = Evidence.from_notebook(nb, notebook)
    return tuple(check.run(evidence) for check in checks)


def summarize(results: Sequence[CheckResult]) -> str:
    failed = [r.name + ("" if r.visible else " (hidden)") for r in results if not r.passed]
    head = f"{len(results) - len(failed)}/{len(results)} checks pass"
    return head + (f"; failed: {'; '.join(failed)}" if failed else "")


def join_reasons(reasons: Sequence[str], limit: int = 3) -> str:
    more = f" (+{len(reasons) - limit} more)" if len(reasons) > limit else ""
    return "; ".join(reasons[:limit]) + more


def grade_notebook(nb, notebook: str, checks: Sequence[Check], *, student: str = "",
                   integrity: bool = True) -> Grade:
    """Grade an already loaded notebook: identity, then seals (`integrity`), then every check."""
    max_score = float(sum(c.points for c in checks))
    try:
        check_identity(nb, notebook)
        rehearsed = tamper.rehearsed(nb)
        if rehearsed:
            raise SubmissionProblem(REHEARSAL, f"{rehearsed}: a rehearsal's stand-in results are not measurements; "
                                    "execute the notebook on the node (or in smoke) and submit that")
        reasons = tamper.problems(nb) if integrity else []
        if reasons:
            raise SubmissionProblem(TAMPERED, join_reasons(reasons))
    except SubmissionProblem as exc:
        return Grade(student, notebook, exc.status, 0.0, max_score, str(exc))
    results = run_checks(nb, notebook, checks)
    score = float(sum(r.earned for r in results))
    return Grade(student, notebook, GRADED, score, max_score, summarize(results), results)
