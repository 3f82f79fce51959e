"""`labkit check NOTEBOOK.ipynb`: run the visible checks and tests on your notebook, say what to fix.

Recorded checks read the executed notebook's results; code tests run the visible tests of each exercise on
the functions its exercise cells define (one subprocess per exercise, with a timeout), from the `tests/`
folder beside the notebook (else the course's notebooks/tests). Exit code 0 when every visible check and
test passes and the recorded results are intact, 1 otherwise, 2 when the file cannot be read as a course
notebook. In a class release the hidden checks and tests run only when the instructor grades (the report ends
saying so). A self-study copy (`make student`, labkit.course.selfstudy) carries the hidden tests in
tests/hidden/: there `labkit check` runs visible + hidden, their messages included (no one grades a learner).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import click

from labkit.course.exercises.grading import DEFAULT_TIMEOUT_S, ExerciseGrade, grade_exercises, plan_for, \
    source_tests_dir
from labkit.course.exercises.hidden import hidden_info, own_hidden_tests
from labkit.errors import GradingError
from labkit.course.grading import tamper
from labkit.course.grading.checks import CheckResult
from labkit.course.grading.evaluate import load_notebook, run_checks
from labkit.course.grading.evidence import IDENTITY_KEY, identity
from labkit.course.grading.registry import checks_for


@dataclass(frozen=True)
class CheckReport:
    notebook: str
    results: tuple[CheckResult, ...]
    """Visible checks only."""
    hidden: int
    problems: tuple[str, ...]
    """Integrity problems the grader would mark `tampered` or `invalid`."""
    code: tuple[ExerciseGrade, ...] = ()
    """Visible tests per code exercise."""
    hidden_code: dict = field(default_factory=dict)
    """{exercise: HiddenInfo}: how many hidden tests each exercise has and what they vary (never their content)."""
    every_test: bool = False
    """A self-study copy: `results` and `code` hold the hidden checks and tests too, with their messages."""

    @property
    def ok(self) -> bool:
        return (not self.problems and all(r.passed for r in self.results)
                and all(g.status == "pass" for g in self.code))


def tests_dir_for(path: Path) -> Path | None:
    """The visible tests of a notebook: tests/ beside it (a release or the source), else the course's."""
    for folder in (path.parent / "tests", source_tests_dir()):
        if folder.is_dir():
            return folder
    return None


def check_notebook(path: str | Path, name: str | None = None, *, tests: str | Path | None = None,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> CheckReport:
    """Pure core: GradingError when `path` is not a readable course notebook."""
    path = Path(path)
    if not path.is_file():
        raise GradingError(f"no notebook at {path}; give the path of your executed .ipynb file")
    nb = load_notebook(path)
    found = identity(nb)
    notebook = found or name or path.stem
    problems = []
    key = ".".join(("metadata",) + IDENTITY_KEY)
    if found is None:
        problems.append(f"{key} is missing: the grader will mark this notebook invalid; "
                        f"work in your copy of the course notebook")
    elif name is not None and name != found:
        problems.append(f"this is notebook {found!r}, not {name!r}")
    checks = checks_for(notebook)
    problems += tamper.problems(nb)
    tests_dir = Path(tests) if tests else tests_dir_for(path)
    own = own_hidden_tests(notebook, tests_dir)
    if own is not None:  # a self-study copy: every check and test, hidden messages shown
        code = tuple(grade_exercises(nb, notebook, plan_for(notebook, tests_dir, own.parent), timeout_s=timeout_s,
                                     reveal_hidden=True))
        return CheckReport(notebook, run_checks(nb, notebook, checks), 0, tuple(problems), code, {}, True)
    visible = [c for c in checks if c.visible]
    plan = plan_for(notebook, tests_dir)
    code = tuple(grade_exercises(nb, notebook, plan, timeout_s=timeout_s))
    return CheckReport(notebook, run_checks(nb, notebook, visible), len(checks) - len(visible), tuple(problems),
                       code, hidden_info(notebook, tests_dir))


def _code_lines(report: CheckReport) -> list[str]:
    lines = []
    for g in report.code:
        lines += _exercise_lines(g)
        info = report.hidden_code.get(g.exercise)
        if info is not None:
            lines.append(f"        {info.line()}")
    return lines


def _exercise_lines(g: ExerciseGrade) -> list[str]:
    passed = sum(r.passed for r in g.results)
    head = f"{g.exercise}: {passed}/{len(g.results)} tests pass"
    if g.status == "pass":
        return [f"  PASS  {head}"]
    if g.status in ("not attempted", "missing"):
        why = ("not attempted: write your code in place of the NotImplementedError in its cell"
               if g.status == "not attempted" else g.reason)
        return [f"  TODO  {g.exercise}: {why}"]
    lines = [f"  FAIL  {head}" + (f" ({g.reason})" if g.status == "error" else "")]
    for r in g.results:
        if not r.passed and (g.status != "error" or r.message != g.reason):
            lines.append(f"        {'' if r.visible else '(hidden) '}{r.name.split(': ', 1)[1]}: {r.message}")
    return lines


def format_report(report: CheckReport) -> str:
    passed = sum(r.passed for r in report.results)
    earned, possible = sum(r.earned for r in report.results), sum(r.points for r in report.results)
    which = "visible + hidden" if report.every_test else "visible"
    lines = [f"{report.notebook}: {passed}/{len(report.results)} {which} checks pass "
             f"({earned:g}/{possible:g} points)"]
    for r in report.results:
        mark = "PASS" if r.passed else "TODO" if r.todo else "FAIL"
        lines.append(f"  {mark}  {r.name} ({r.points:g} pts)" + ("" if r.passed else f"\n        fix: {r.message}"))
    if report.code:
        done = sum(g.status == "pass" for g in report.code)
        lines.append(f"code exercises: {done}/{len(report.code)} pass their {which} tests")
        lines += _code_lines(report)
    for problem in report.problems:
        lines.append(f"  FIX   {problem}")
    if report.every_test:
        lines.append(f"every check and test ran, visible + hidden (your own copy carries the hidden tests: your "
                     f"answer key); a reference solution: `labkit solution {report.notebook} NAME` (no NAME: the list)")
    elif report.hidden or report.hidden_code:
        tests = sum(info.tests for info in report.hidden_code.values())
        adds = [f"{report.hidden} hidden check(s)"] * bool(report.hidden) + \
            [f"{tests} hidden test(s) with other sizes and world sizes"] * bool(tests)
        lines.append(f"visible {'tests' if tests else 'checks'} only: the graded run adds {' and '.join(adds)}")
    return "\n".join(lines)


@click.command("check")
@click.argument("notebook", type=click.Path())
@click.option("--as", "name", default=None, help="Course notebook name, e.g. 01_memory (default: from metadata).")
@click.option("--tests", type=click.Path(), default=None,
              help="Folder of visible tests (default: tests/ beside the notebook, else the course's).")
@click.option("--timeout", type=float, default=DEFAULT_TIMEOUT_S, show_default=True,
              help="Seconds per code exercise (all its visible tests).")
@click.pass_context
def command(ctx, notebook, name, tests, timeout):
    """Run the visible checks and code tests on NOTEBOOK (saved) and print what passes and what to fix; in a
    self-study copy (make student) the hidden ones too."""
    try:
        report = check_notebook(notebook, name, tests=tests, timeout_s=timeout)
    except GradingError as exc:
        click.echo(f"error: {exc}", err=True)
        ctx.exit(2)
    click.echo(format_report(report))
    ctx.exit(0 if report.ok else 1)
