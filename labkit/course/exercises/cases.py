"""Test cases of the code exercises: the `@case` decorator, loading test files, running cases.

A test file (`notebooks/tests/NN_x.py` visible, `notebooks/tests/hidden/NN_x.py` hidden) holds functions
decorated with `@case("<exercise id>", points=N)`; each receives the student's function and fails by
raising. Hidden files may declare `MUTANTS = {"<id>": [(fragment, replacement), ...]}` (see the suite's
mutation test). Files are loaded as fresh modules that are NOT registered in `sys.modules`, so cloudpickle
ships their helper functions to spawned ranks by value. docs/grading.md ("For authors") explains the pattern.
"""
from __future__ import annotations

import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from labkit.errors import LabkitError

#: Attribute the decorator sets on a test function.
_CASE_ATTR = "__labkit_case__"


class ExerciseError(LabkitError, RuntimeError):
    """Student code failed in a way the exercise machinery reports: a rank raised, a run hung.

    `not_attempted` is True when the failure is the release's stub (NotImplementedError).
    """

    def __init__(self, message: str, *, rank: int | None = None, traceback: str = "",
                 not_attempted: bool = False):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.not_attempted = not_attempted


@dataclass(frozen=True)
class Case:
    """One test of one exercise."""

    exercise: str
    """The exercise id = the name of the graded function."""
    name: str
    """The test function's name (shown in feedback, also for hidden tests)."""
    points: float
    """Points earned when the test passes (partial credit per test)."""
    fn: Callable
    """The test: `fn(student_function)`; raises to fail."""
    hidden: bool = False
    """Loaded from a hidden test file: its message, inputs and expected values are never shown."""


@dataclass(frozen=True)
class CaseResult:
    """The outcome of one case on one student function."""

    case: Case
    status: str
    """"pass", "fail" or "not attempted"."""
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def score(self) -> float:
        return self.case.points if self.passed else 0.0


def case(exercise: str, *, points: float = 1):
    """Mark a test function as a case of `exercise` worth `points` (see the module docstring)."""
    if not isinstance(exercise, str) or not exercise.isidentifier():
        raise ValueError(f"case({exercise!r}): the exercise id must be the graded function's name")
    if not points > 0:
        raise ValueError(f"case({exercise!r}, points={points!r}): points must be > 0")

    def mark(fn: Callable) -> Callable:
        setattr(fn, _CASE_ATTR, (exercise, float(points)))
        return fn

    return mark


def _is_hidden_dir(path: Path) -> bool:
    return path.parent.name in ("hidden", "autograder")


def load_module(path: str | Path, text: str | None = None) -> types.ModuleType:
    """Execute a test file (or its `text`) in a fresh module, not in sys.modules: cloudpickle ships it by value."""
    path = Path(path)
    module = types.ModuleType(f"labkit_exercise_tests_{path.stem}")
    module.__dict__["__labkit_test_file__"] = str(path)
    code = compile(path.read_text() if text is None else text, str(path), "exec")
    exec(code, module.__dict__)  # noqa: S102 - the course's own test files
    return module


def load_cases(path: str | Path, *, hidden: bool | None = None) -> list[Case]:
    """The cases of one test file, in file order. `hidden` defaults to "the file sits in hidden/ or autograder/"."""
    path = Path(path)
    return _cases(load_module(path), _is_hidden_dir(path) if hidden is None else hidden)


def load_cases_from_text(text: str, file_name: str, *, hidden: bool) -> list[Case]:
    """The cases of a test file's text (the grader ships tests to the sandbox as text, not as a path)."""
    return _cases(load_module(file_name, text), hidden)


def _cases(module: types.ModuleType, hidden: bool) -> list[Case]:
    cases = []
    for name, obj in vars(module).items():
        mark = getattr(obj, _CASE_ATTR, None)
        if callable(obj) and mark is not None:
            cases.append(Case(exercise=mark[0], name=name, points=mark[1], fn=obj, hidden=hidden))
    return cases


def load_mutants(path: str | Path) -> dict[str, list[tuple[str, str]]]:
    """The MUTANTS dict of a hidden test file ({} when it declares none)."""
    return dict(getattr(load_module(path), "MUTANTS", {}))


def _is_stub(exc: BaseException) -> bool:
    return isinstance(exc, NotImplementedError) or (isinstance(exc, ExerciseError) and exc.not_attempted)


def run_case(case_: Case, fn: Callable) -> CaseResult:
    """Run one case on `fn`: pass, fail (with the error as message) or not attempted (the stub raised)."""
    try:
        case_.fn(fn)
    except Exception as exc:  # noqa: BLE001 - any error of student code fails the case
        if _is_stub(exc):
            return CaseResult(case_, "not attempted", str(exc))
        if isinstance(exc, AssertionError):
            message = str(exc) or _last_frame(exc)
        else:
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


def run_cases(fn: Callable, cases: list[Case]) -> list[CaseResult]:
    """Run `cases` on `fn`; once the stub answers NotImplementedError, the rest are not attempted too."""
    results = []
    for case_ in cases:
        if results and results[-1].status == "not attempted":
            results.append(CaseResult(case_, "not attempted", results[-1].message))
            continue
        results.append(run_case(case_, fn))
    return results
