"""Code exercises: students write the functions that matter; tests check them (issue #15).

In a notebook, after an exercise cell that defines `def <id>(...)`:

    from labkit.course import exercises as ex
    ex.check(<id>)                      # the visible tests of the exercise: PASS/FAIL per test
    mine = ex.attempt(run_mine, <id>)   # run_mine(<id>), or None + "not attempted" on the stub

Test files sit beside the notebooks (`tests/NN_x.py` visible, `tests/hidden/NN_x.py` hidden) and hold
`@case("<id>", points=N)` functions taking a `Student` (`student.call`, `student.run`, `student.spawn`;
`reference` and `trusted_spawn` for expected values, labkit.course.exercises.student). `labkit assign`
makes the student release, `labkit check` / `labkit grade` run the tests in their own process on a
submission's exercise cells, run in another (labkit.course.exercises.judge). docs/grading.md explains the
pattern for authors and instructors.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from labkit.course.exercises.cases import Case, CaseResult, ExerciseError, Mutant, case, load_cases, load_mutants
from labkit.course.exercises.expect import ANY, Either, Float, List, Tensor, close, like, max_error, pairs
from labkit.course.exercises.spawn import spawn
from labkit.course.exercises.student import Student, StudentError, reference, trusted_spawn
from labkit.course.exercises.verdicts import run_cases

__all__ = ["ANY", "Case", "CaseResult", "Either", "ExerciseError", "Float", "List", "Mutant", "Student",
           "StudentError", "Tensor", "attempt", "case", "check", "close", "find_cases", "like", "load_cases",
           "load_mutants", "max_error", "pairs", "reference", "run_cases", "spawn", "trusted_spawn"]


def find_cases(exercise: str, tests: str | Path | None = None) -> list[Case]:
    """The visible cases of `exercise`: from the file `tests`, else from `tests/*.py` under the current
    folder (papermill and Jupyter run a notebook with its folder as the working directory)."""
    return _find(exercise, tests)[0]


def _find(exercise: str, tests: str | Path | None) -> tuple[list[Case], list[Path]]:
    if tests is not None:
        files = [Path(tests)]
        if not files[0].is_file():
            raise ExerciseError(f"check(tests={str(tests)!r}): no such test file")
    else:
        folder = next((d for d in (Path("tests"), Path("notebooks", "tests")) if d.is_dir()), None)
        if folder is None:
            raise ExerciseError(f"check({exercise}): no tests/ folder beside this notebook (in {Path.cwd()}); "
                                "pass tests='path/to/tests.py'")
        files = [f for f in sorted(folder.glob("*.py")) if exercise in f.read_text()]  # load only likely files
    loaded = [(f, [c for c in load_cases(f) if c.exercise == exercise]) for f in files]
    cases = [c for _, mine in loaded for c in mine]
    if not cases:
        where = files[0] if tests is not None else f"{Path.cwd() / 'tests'}/*.py"
        raise ExerciseError(f"check({exercise}): no visible test of exercise {exercise!r} in {where}")
    return cases, [f for f, mine in loaded if mine]


def report(exercise: str, results: list[CaseResult], hidden: str = "") -> str:
    """The text `check` prints: one line per test, hidden tests without their message, then `hidden` (what
    the instructor's hidden tests add: labkit.course.exercises.hidden.HiddenInfo.line)."""
    tail = f"\n  {hidden}" if hidden else ""
    if results and all(r.status == "not attempted" for r in results):
        return f"{exercise}: not attempted ({results[0].message}){tail}"
    passed = sum(r.passed for r in results)
    lines = [f"{exercise}: {passed}/{len(results)} tests pass"]
    for r in results:
        pts = f"({r.case.points:g} pt{'s' if r.case.points != 1 else ''})"
        if r.passed:
            lines.append(f"  PASS {r.case.name} {pts}")
        elif r.case.hidden:
            lines.append(f"  FAIL hidden test {r.case.name} {pts}")
        else:
            lines.append(f"  FAIL {r.case.name} {pts}: {r.message}")
    return "\n".join(lines) + tail


def check(fn: Callable, tests: str | Path | None = None) -> None:
    """Run the visible tests of exercise `fn.__name__` on `fn` and print PASS/FAIL per test.

    The release's stub (NotImplementedError) prints "not attempted" and does not raise, so an
    unattempted notebook still runs to the end. Here the student's own process is the grader: these are the
    same tests, verdicts and messages as `labkit check` and `labkit grade` give, for the student's feedback.
    In a notebook `labkit grade --execute` runs, it only says so: the grader runs the tests on the cell.
    """
    import os

    from labkit.runtime import rehearsal
    from labkit.course.exercises.hidden import OWN_COPY, hidden_info, own_hidden_tests
    from labkit.course.grading.sandbox import GRADED_RUN_ENV

    exercise = fn.__name__
    if os.environ.get(GRADED_RUN_ENV):
        print(f"{exercise}: graded by the instructor's tests outside this notebook")
        return
    if rehearsal.active():  # the tests run the student's function on CPU, the same on every profile
        print(f"{exercise}: visible tests not run in a rehearsal (profile-independent; `labkit check` runs them)")
        return
    cases, files = _find(exercise, tests)
    info = hidden_info(files[0].stem, files[0].parent).get(exercise) if files else None
    own = bool(files) and own_hidden_tests(files[0].stem, files[0].parent) is not None  # a self-study copy
    print(report(exercise, run_cases(fn, cases), (info.line(OWN_COPY) if own else info.line()) if info else ""))


def attempt(fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)`, or None (and a "not attempted" line) when an exercise stub raised."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as exc:
        print(f"not attempted yet: {exc}")
    except ExerciseError as exc:
        if not exc.not_attempted:
            raise
        print(f"not attempted yet: {exc}")
    return None
