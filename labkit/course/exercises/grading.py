"""Grade the code exercises of one notebook: its exercise cells against the visible (and hidden) tests.

Per exercise, one process runs the student's cell (sandboxed when `isolation` is given: `labkit grade`; plain
with a timeout for `labkit check` on a student's own machine) and the tests run in THIS process, the grader's
(labkit.course.exercises.judge). Each test becomes a `CheckResult` named "<exercise>: <test>" with its points
from the grader's own plan (partial credit per test); a hidden test is `visible=False`, so feedback shows its
name and pass/fail only. An exercise whose process hangs, crashes or prints past the cap fails the tests it
had not finished, with a reason; the other exercises still run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from labkit.course.exercises.cases import Case, CaseResult, load_cases, spawn_imports
from labkit.course.exercises.judge import Channel, VariantResult, judge
from labkit.course.exercises.source import exercise_cells, untouched_stub
from labkit.course.grading.checks import CheckResult

#: Seconds per exercise (all its tests in one process) unless the caller says otherwise.
DEFAULT_TIMEOUT_S = 300.0


def source_tests_dir() -> Path:
    """notebooks/tests of the source tree this labkit was imported from (it may not exist: an installed wheel)."""
    from labkit.course import source_tree

    return source_tree() / "notebooks" / "tests"


def visible_dir_of(autograder: Path) -> Path:
    """Where the visible tests sit next to an autograder folder: DIR/visible (a release) or the parent of
    notebooks/tests/hidden (the source tree)."""
    return autograder / "visible" if (autograder / "visible").is_dir() else autograder.parent


def autograder_dir(autograder: str | Path | None) -> Path | None:
    """The hidden tests' folder: `autograder` if given, else the source tree's notebooks/tests/hidden (if any)."""
    if autograder is not None:
        return Path(autograder)
    default = source_tests_dir() / "hidden"
    return default if default.is_dir() else None


def plan_for_autograder(notebook: str, autograder: str | Path | None) -> "Plan":
    """The visible + hidden test files of `notebook` for `labkit grade --autograder`."""
    hidden = autograder_dir(autograder)
    return plan_for(notebook, visible_dir_of(hidden) if hidden else source_tests_dir(), hidden)


@dataclass(frozen=True)
class ExerciseGrade:
    exercise: str
    status: str
    """pass (every test), partial, fail, not attempted, missing (no cell) or error (hang / crash / output cap)."""
    reason: str
    results: tuple[CheckResult, ...] = field(default_factory=tuple)

    @property
    def score(self) -> float:
        return sum(r.earned for r in self.results)


@dataclass(frozen=True)
class Plan:
    """The test files of one notebook and the exercises they test, in file order: the grader's own record of
    every test's name, points and visibility (nothing a student's process reports changes them)."""

    visible: tuple[Path, ...]
    hidden: tuple[Path, ...]
    exercises: tuple[str, ...]
    points: dict

    @property
    def max_score(self) -> float:
        return float(sum(self.points.values()))

    def cases(self, exercise: str) -> list[Case]:
        """The cases of `exercise`, visible then hidden, from freshly loaded modules (no state shared between
        submissions)."""
        return [c for p in self.visible + self.hidden for c in load_cases(p, hidden=p in self.hidden)
                if c.exercise == exercise]


def plan_for(notebook: str, visible_dir: Path | None, hidden_dir: Path | None = None) -> Plan:
    visible, hidden = (tuple(p for p in ([Path(d) / f"{notebook}.py"] if d else []) if p.is_file())
                       for d in (visible_dir, hidden_dir))
    exercises: list[str] = []
    points: dict[str, float] = {}
    for path in visible + hidden:
        for case in load_cases(path, hidden=path in hidden):
            if case.exercise not in exercises:
                exercises.append(case.exercise)
            points[case.exercise] = points.get(case.exercise, 0.0) + case.points
    return Plan(visible, hidden, tuple(exercises), points)


def run_variants(exercise: str, sources: list[str], plan: Plan, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 memory_bytes: int = 8 * 2**30, output_bytes: int = 50 * 2**20, isolation=None, private: tuple = (),
                 kernel: str = "labkit", cache: dict | None = None,
                 channel: Channel | None = None) -> list[VariantResult]:
    """Every case of `exercise` on each source variant (the submitted cell; in CI the solution and its mutants),
    judged in this process (labkit.course.exercises.judge): hidden tests' messages included (the grader's own
    data; what feedback shows of them is _check_results' business). `channel`: its process, started ahead
    by `open_channel` with the same limits (judged and closed here)."""
    cases = plan.cases(exercise)
    return judge(exercise, sources, cases, **_channel_options(cases, timeout_s=timeout_s, memory_bytes=memory_bytes,
                                                              output_bytes=output_bytes, isolation=isolation,
                                                              private=private, kernel=kernel),
                 cache=cache, channel=channel)


def _channel_options(cases: list[Case], *, output_bytes: int, **limits) -> dict:
    from labkit.course.exercises import wire

    # an answer is output too: --output-mib caps it (refused before it is read); a process whose tests spawn
    # imports torch and starts its ranks' forkserver before it says it is ready
    return dict(limits, output_bytes=output_bytes, max_message=min(wire.MAX_BYTES, output_bytes),
                warm=spawn_imports(cases))


def open_channel(exercise: str, plan: Plan, **limits) -> Channel:
    """The process of `exercise` with `limits` (run_variants' keywords), started now: ahead of its turn."""
    return Channel(**_channel_options(plan.cases(exercise), **limits))


def _check_results(exercise: str, variant: VariantResult, reveal_hidden: bool) -> tuple[str, str, tuple]:
    """(status, reason, CheckResults) of one exercise from its VariantResult."""
    out, statuses = [], []
    for r in variant.results:
        passed = r.status == "pass"
        statuses.append(r.status)
        if passed:
            message = "passes"
        elif r.status == "not attempted":
            message = "not attempted: replace the NotImplementedError in the exercise cell with your code"
        else:
            message = r.message or "fails"
        if r.case.hidden and not reveal_hidden and not passed:
            message = ""
        out.append(CheckResult(f"{exercise}: {r.case.name}", r.case.points, r.case.points if passed else 0.0,
                               passed, not r.case.hidden, message))
    if variant.kind == "process":
        return "error", variant.error, tuple(out)
    if variant.kind == "cell":
        return "fail", variant.error, tuple(out)
    if statuses and all(s == "not attempted" for s in statuses):
        return "not attempted", "not attempted", tuple(out)
    npass = statuses.count("pass")
    status = "pass" if npass == len(statuses) else "partial" if npass else "fail"
    failing = [r.name.split(": ", 1)[1] + ("" if r.visible else " (hidden)") for r in out if not r.passed]
    return status, ("failing: " + ", ".join(failing)) if failing else "", tuple(out)


def _missing(exercise: str, plan: Plan) -> ExerciseGrade:
    reason = (f"no exercise cell defines {exercise}; restore the cell that starts with `# EXERCISE {exercise}` "
              "from the course notebook")
    return ExerciseGrade(exercise, "missing", reason, tuple(
        CheckResult(f"{exercise}: {c.name}", c.points, 0.0, False, not c.hidden, "" if c.hidden else reason)
        for c in plan.cases(exercise)))


def _untouched(exercise: str, plan: Plan, reveal_hidden: bool) -> ExerciseGrade:
    """What running the release's stub gives (its first test meets NotImplementedError, every test is then not
    attempted), without starting the student's process."""
    message = f"exercise {exercise}: write your code here"
    variant = VariantResult(tuple(CaseResult(c, "not attempted", message) for c in plan.cases(exercise)))
    return ExerciseGrade(exercise, *_check_results(exercise, variant, reveal_hidden))


def grade_exercises(nb, notebook: str, plan: Plan, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                    memory_bytes: int = 8 * 2**30, output_bytes: int = 50 * 2**20, isolation=None,
                    private: tuple = (), kernel: str = "labkit", reveal_hidden: bool = False) -> list[ExerciseGrade]:
    """Run every exercise of `plan` on the cells of `nb`; one ExerciseGrade each, never raises for student code.

    Each exercise gets a fresh process of its own; the next exercise's is started while this one's tests run
    (one process ahead at most: it imports and readies itself meanwhile, issue #39). Every process started
    here is reaped before this returns, also on an error or Ctrl-C (the one ahead is killed then)."""
    cells = exercise_cells(nb)
    limits = dict(timeout_s=timeout_s, memory_bytes=memory_bytes, output_bytes=output_bytes, isolation=isolation,
                  private=private, kernel=kernel)
    runs = [e for e in plan.exercises if e in cells and not untouched_stub(cells[e], e)]  # those with a process
    started: list[Channel] = []
    grades = []
    cache: dict = {}  # the references (grader-side, deterministic) shared by the exercises: 08's recorded trace

    def start(exercise: str) -> Channel:
        started.append(open_channel(exercise, plan, **limits))
        return started[-1]

    try:
        for exercise in plan.exercises:
            if exercise not in cells:
                grades.append(_missing(exercise, plan))
            elif exercise not in runs:  # the release's stub: no process to start (issue #39)
                grades.append(_untouched(exercise, plan, reveal_hidden))
            else:
                channel = started[-1] if started and not started[-1].closed else start(exercise)
                following = runs[runs.index(exercise) + 1:]
                if following:
                    start(following[0])
                variant = run_variants(exercise, [cells[exercise]], plan, channel=channel, cache=cache, **limits)[0]
                grades.append(ExerciseGrade(exercise, *_check_results(exercise, variant, reveal_hidden)))
    finally:
        for channel in started:  # those judged are closed already; one started ahead and never judged is killed
            if not channel.closed:
                channel.close_quietly()
                channel.close()
    return grades


def summary(grades: list[ExerciseGrade]) -> str:
    """One line for the gradebook: every exercise's score, and why one got nothing."""
    parts = []
    for g in grades:
        earned, possible = g.score, sum(r.points for r in g.results)
        why = f" ({g.status}: {g.reason})" if g.status in ("error", "missing") else \
            f" ({g.status})" if g.status == "not attempted" else ""
        parts.append(f"{g.exercise} {earned:g}/{possible:g}{why}")
    return "code: " + "; ".join(parts)


def merge(grade, grades: list[ExerciseGrade]):
    """`grade` (a gradebook row) with the code tests' results, points and a summary added."""
    from dataclasses import replace

    results = tuple(r for g in grades for r in g.results)
    return replace(grade, score=grade.score + sum(r.earned for r in results),
                   max_score=grade.max_score + sum(r.points for r in results),
                   results=tuple(grade.results) + results,
                   detail=f"{grade.detail}; {summary(grades)}" if grade.detail else summary(grades))


def full_marks_problems(executed: str | Path, tests_dir: str | Path | None = None, *,
                        code_tests: bool = True) -> list[str]:
    """Why an executed SOURCE notebook does not get full marks (recorded checks + visible and hidden code
    tests, hidden messages shown: this is for CI and authors); [] when it does. `code_tests=False` runs
    the recorded checks only and just requires every exercise's cell (tests/test_notebooks.py: the code
    tests of the same cells run in tests/test_exercises_ci.py, with their mutants, in one process each)."""
    from labkit.course.grading.evaluate import GRADED, grade_notebook, load_notebook
    from labkit.course.grading.evidence import identity
    from labkit.course.grading.registry import checks_for
    from labkit.errors import GradingError

    nb = load_notebook(executed)
    notebook = identity(nb) or Path(executed).stem
    try:
        checks = checks_for(notebook)
    except GradingError:
        checks = ()
    tests = Path(tests_dir) if tests_dir else source_tests_dir()
    plan = plan_for(notebook, tests, tests / "hidden")
    if code_tests:
        code = grade_exercises(nb, notebook, plan, reveal_hidden=True)
    else:
        code = [_missing(exercise, plan) for exercise in plan.exercises if exercise not in exercise_cells(nb)]
    grade = merge(grade_notebook(nb, notebook, checks), code)
    problems = [] if grade.status == GRADED else [f"{grade.status}: {grade.detail}"]
    return problems + [f"{r.name}: {r.message}" for r in grade.results if not r.passed]
