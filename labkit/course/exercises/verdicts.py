"""Run test cases and decide their verdicts: pass, fail or not attempted (issue #26).

`run_cases(fn, cases, student=...)` runs each case with a Student (labkit.course.exercises.student): a
`LocalStudent` of `fn` in a student's own notebook, the judge's `RemoteStudent` when grading. A case passes
when its test function returns, fails when it raises (the test's own AssertionError, a StudentError from the
student's code, a ReturnTypeError), and is not attempted when the release's stub answered. The verdict is
decided here, in the process that runs the tests.
"""
from __future__ import annotations

import traceback
from pathlib import Path
from typing import Callable

from labkit.course.exercises.cases import Case, CaseResult
from labkit.course.exercises.student import LocalStudent, NotAttempted, StudentError, StudentGone, judging


def run_case(case_: Case, student) -> CaseResult:
    """Run one case with `student` (a Student). Pass when
    the test returns, fail when it raises (its message), not attempted when the stub answered. A Student
    whose process is gone raises StudentGone through."""
    try:
        case_.fn(student)
    except StudentGone:
        raise
    except NotAttempted as exc:
        return CaseResult(case_, "not attempted", str(exc))
    except Exception as exc:  # noqa: BLE001 - any error fails the case
        if isinstance(exc, (AssertionError, StudentError)):
            message = str(exc) or _last_frame(exc)
        else:  # the test itself choked on what came back
            message = f"{type(exc).__name__}: {exc}"
        return CaseResult(case_, "fail", message)
    return CaseResult(case_, "pass")


def _last_frame(exc: BaseException) -> str:
    """'assert failed at line N: <source>' for a bare assert."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "assertion failed"
    last = frames[-1]
    return f"assertion failed at {Path(last.filename).name}:{last.lineno}: {last.line}"


def run_cases(fn: Callable | None, cases: list[Case], *, student=None, cache: dict | None = None,
              before: Callable[[Case], None] | None = None) -> list[CaseResult]:
    """Run `cases`: each gets `student` (default: a LocalStudent of `fn`, one per exercise). Once
    the stub answers NotImplementedError the rest are not attempted too; once the student's process is
    gone the rest fail with its reason. `cache` holds the references of this run (see student.reference);
    `before(case)` is called as each case starts."""
    results: list[CaseResult] = []
    stop: tuple[str, str] | None = None
    local: dict[str, LocalStudent] = {}  # one per exercise: its tests share its runs (`student.spawn(share=True)`)
    for case_ in cases:
        if stop is not None:
            results.append(CaseResult(case_, *stop))
            continue
        if student is None and case_.exercise not in local:
            local[case_.exercise] = LocalStudent(fn, case_.exercise)
        if before is not None:
            before(case_)
        try:
            with judging(cache):
                result = run_case(case_, student or local[case_.exercise])
        except StudentGone as exc:
            result, stop = CaseResult(case_, "fail", str(exc)), ("fail", str(exc))
        results.append(result)
        if result.status == "not attempted":
            stop = ("not attempted", result.message)
    return results
