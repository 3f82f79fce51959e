"""`labkit check NOTEBOOK.ipynb`: run the visible checks on your executed notebook, say what to fix.

Exit code 0 when every visible check passes and the recorded results are intact, 1 otherwise, 2 when the
file cannot be read as a course notebook. Hidden checks run only when the instructor grades.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

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

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.passed for r in self.results)


def check_notebook(path: str | Path, name: str | None = None) -> CheckReport:
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
    visible = [c for c in checks if c.visible]
    return CheckReport(notebook, run_checks(nb, notebook, visible), len(checks) - len(visible), tuple(problems))


def format_report(report: CheckReport) -> str:
    passed = sum(r.passed for r in report.results)
    earned, possible = sum(r.earned for r in report.results), sum(r.points for r in report.results)
    lines = [f"{report.notebook}: {passed}/{len(report.results)} visible checks pass "
             f"({earned:g}/{possible:g} points)"]
    for r in report.results:
        mark = "PASS" if r.passed else "FAIL"
        lines.append(f"  {mark}  {r.name} ({r.points:g} pts)" + ("" if r.passed else f"\n        fix: {r.message}"))
    for problem in report.problems:
        lines.append(f"  FIX   {problem}")
    if report.hidden:
        lines.append(f"{report.hidden} hidden check(s) run when your instructor grades.")
    return "\n".join(lines)


@click.command("check")
@click.argument("notebook", type=click.Path())
@click.option("--as", "name", default=None, help="Course notebook name, e.g. 01_memory (default: from metadata).")
@click.pass_context
def command(ctx, notebook, name):
    """Run the visible checks on NOTEBOOK (executed and saved) and print what passes and what to fix."""
    try:
        report = check_notebook(notebook, name)
    except GradingError as exc:
        click.echo(f"error: {exc}", err=True)
        ctx.exit(2)
    click.echo(format_report(report))
    ctx.exit(0 if report.ok else 1)
