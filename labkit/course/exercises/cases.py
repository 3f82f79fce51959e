"""Test cases of the code exercises: the `@case` decorator, loading test files, running cases.

A test file (`notebooks/tests/NN_x.py` visible, `notebooks/tests/hidden/NN_x.py` hidden) holds functions
decorated with `@case("<exercise id>", points=N)`; each receives a `Student` (labkit.course.exercises.student:
`student.call`, `student.run`, `student.spawn`) and fails by raising. The hidden file also declares
`MUTANTS = {"<id>": [(fragment, replacement), (fragment, replacement, "fix words"), ...]}` (a 3-tuple is a
VISIBLE mutant: a visible test must fail on it with a message containing the fix words) and
`VARIES = {"<id>": "what the hidden tests vary"}` (shown by `ex.check` and `labkit check`).
Files are loaded as fresh modules that are NOT registered in `sys.modules`, so cloudpickle ships their
harness functions to the student's side by value. docs/grading.md ("For authors") explains the pattern.
"""
from __future__ import annotations

import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from labkit.errors import LabkitError

#: Attribute the decorator sets on a test function.
_CASE_ATTR = "__labkit_case__"
#: The only outcomes of a test.
STATUSES = ("pass", "fail", "not attempted")
#: Characters kept of a test's message.
MESSAGE_CHARS = 500


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
    """The test: `fn(student)` (a Student, never the student's function); raises to fail."""
    hidden: bool = False
    """Loaded from a hidden test file: its message, inputs and expected values are never shown."""


@dataclass(frozen=True)
class CaseResult:
    """The outcome of one case on one student function."""

    case: Case
    status: str
    """"pass", "fail" or "not attempted"."""
    message: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"case status {self.status!r}; one of {STATUSES}")
        object.__setattr__(self, "message", str(self.message)[:MESSAGE_CHARS])

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


def visible_twin(hidden_file: str | Path) -> types.ModuleType:
    """The visible test file of a hidden one, loaded afresh, so hidden tests reuse its harnesses and helpers with
    other inputs: tests/hidden/NN_x.py -> tests/NN_x.py (source tree), autograder/NN_x.py ->
    autograder/visible/NN_x.py (a release). In a hidden file: `visible = visible_twin(__labkit_test_file__)`."""
    path = Path(hidden_file)
    for candidate in (path.parent / "visible" / path.name, path.parent.parent / path.name):
        if candidate.is_file():
            return load_module(candidate)
    raise ExerciseError(f"{path}: no visible test file {path.name} in {path.parent / 'visible'} or {path.parent.parent}")


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


def spawn_imports(cases: list[Case]) -> tuple[str, ...] | None:
    """None when no test of `cases` calls `student.spawn`, read from its code: its own, its lambdas' and that of
    the functions of its test file it names, at any depth; else the modules such a call names in `imports=`
    (module-level tuples of module names, e.g. 04's LLAMA). Only a hint (issue #39): the process of an exercise
    whose tests spawn starts its ranks' forkserver with those imports before its turn; a miss only costs time."""
    seen: set = set()
    found, imports = False, []
    todo = [(c.fn.__code__, c.fn.__globals__) for c in cases if hasattr(c.fn, "__code__")]
    while todo:
        code, names = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        if "spawn" in code.co_names:
            found = True
            if any(isinstance(k, tuple) and "imports" in k for k in code.co_consts):  # spawn(..., imports=NAME)
                imports += [m for n in code.co_names for m in _module_names(names.get(n)) if m not in imports]
        todo += [(const, names) for const in code.co_consts if isinstance(const, types.CodeType)]
        todo += [(names[n].__code__, names) for n in code.co_names
                 if isinstance(names.get(n), types.FunctionType) and names[n].__globals__ is names]
    return tuple(imports) if found else None


def _module_names(value) -> tuple[str, ...]:
    """`value` when it is a non-empty tuple of dotted module names, else ()."""
    ok = (isinstance(value, tuple) and value
          and all(isinstance(v, str) and re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", v) for v in value))
    return value if ok else ()


@dataclass(frozen=True)
class Mutant:
    """A classic mistake: `fragment` of the solution replaced by `replacement`. With `fix`, a VISIBLE test
    must fail on it, with `fix` in its message (the words that name the fix); without, any test may."""

    fragment: str
    replacement: str
    fix: str | None = None

    @property
    def visible(self) -> bool:
        return self.fix is not None


def load_mutants(path: str | Path) -> dict[str, list[Mutant]]:
    """The MUTANTS of a hidden test file ({} when it declares none)."""
    out = {}
    for exercise, entries in dict(getattr(load_module(path), "MUTANTS", {})).items():
        out[exercise] = [Mutant(*entry) for entry in entries]
    return out


def load_varies(path: str | Path) -> dict[str, str]:
    """The VARIES of a hidden test file: what its tests of each exercise vary, in one line each."""
    return {str(k): str(v) for k, v in dict(getattr(load_module(path), "VARIES", {})).items()}
