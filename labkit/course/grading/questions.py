"""Points per question in the gradebook (issue #40 item 4): one column per check and per exercise test.

The columns are the grader's plan, never a submission's: every declared check of a notebook
(labkit.course.grading.registry) and every test of its code exercises (the grader's test files), in that
order, each with its points possible. A row's cell is what it earned on that question; a row of another
notebook leaves it empty, and a row with no result for it (invalid, tampered, missing) has 0.

grades.csv always carries them (after `detail`); `--export-questions` puts them into canvas.csv (one column per
question, its points in `Points Possible`) and gradescope/<notebook>.csv (after `Score`) too.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from labkit.errors import GradingError


@dataclass(frozen=True)
class Question:
    notebook: str
    name: str
    """The check's or the test's name (a test as `exercise: test`), as in CheckResult.name."""
    points: float
    nth: int = 1
    """Which of the notebook's questions of that name (a name declared twice gets two columns)."""

    @property
    def header(self) -> str:
        return f"{self.notebook}: {self.name}" + (f" ({self.nth})" if self.nth > 1 else "")


def plan(notebook: str, code_plan=None) -> list[Question]:
    """The questions of `notebook`: its checks, then its exercises' tests (`code_plan`: exercises.grading.Plan)."""
    from labkit.course.grading.registry import checks_for

    try:
        named = [(c.name, float(c.points)) for c in checks_for(notebook)]
    except GradingError:
        named = []
    if code_plan is not None:
        named += [(f"{ex}: {case.name}", float(case.points)) for ex in code_plan.exercises
                  for case in code_plan.cases(ex)]
    seen: Counter = Counter()
    out = []
    for name, points in named:
        seen[name] += 1
        out.append(Question(notebook, name, points, seen[name]))
    return out


def as_data(questions: Sequence[Question]) -> list[list]:
    return [[q.notebook, q.name, q.points, q.nth] for q in questions]


def from_data(data) -> list[Question]:
    return [Question(str(a), str(b), float(c), int(d)) for a, b, c, d in data or ()]


def earned(row, questions: Sequence[Question]) -> list[str]:
    """The cells of `row` under `questions`: points earned, 0 when it has no result for one, '' for another
    notebook's."""
    got: dict[tuple[str, int], float] = {}
    seen: Counter = Counter()
    for result in row.results:
        seen[result.name] += 1
        got.setdefault((result.name, seen[result.name]), float(result.earned))
    return [(f"{min(max(got.get((q.name, q.nth), 0.0), 0.0), q.points):g}" if q.notebook == row.notebook else "")
            for q in questions]
