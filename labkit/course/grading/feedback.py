"""One self-contained HTML feedback page per student.

Each check is named with its points and pass/fail; a visible check also shows its message (what to fix).
A hidden check shows only its name and pass/fail: never its message, code or expected values. Every
string from a submission is cleaned (printable UTF-8, bounded: labkit.course.grading.text.clean) and
HTML-escaped, and every page is written on its own: one that cannot be rendered gets a short page saying so,
the others are untouched. The instructor's review notes (Grade.review) never appear here.
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Sequence

from labkit.course.grading.checks import CheckResult
from labkit.course.grading.evaluate import GRADED, Grade
from labkit.course.grading.text import clean


def _esc(value, limit: int = 2000) -> str:
    return html.escape(clean(value, limit))

_CSS = """body{font-family:system-ui,sans-serif;max-width:56rem;margin:2rem auto;padding:0 1rem;color:#222}
table{border-collapse:collapse;width:100%;margin:.5rem 0 1.5rem}td,th{border:1px solid #ccc;padding:.3rem .5rem;
text-align:left;vertical-align:top}.pass{color:#176b1a;font-weight:600}.fail{color:#a31515;font-weight:600}
.status{padding:.1rem .4rem;border-radius:.3rem;background:#eee}.hidden{color:#666;font-style:italic}"""


def _check_row(result: CheckResult) -> str:
    verdict = ('<span class="pass">pass</span>' if result.passed else
               '<span class="fail">todo</span>' if getattr(result, "todo", False) and result.visible else
               '<span class="fail">fail</span>')
    if result.visible:
        name, message = _esc(result.name, 300), _esc(result.message)
    else:
        name, message = f'{_esc(result.name, 300)} <span class="hidden">(hidden)</span>', ""
    return (f"<tr><td>{name}</td><td>{float(result.earned):g} / {float(result.points):g}</td><td>{verdict}</td>"
            f"<td>{message}</td></tr>")


def _notebook_section(grade: Grade) -> str:
    head = (f"<h2>{_esc(grade.notebook or '(no notebook)', 300)}: {grade.score:g} / {grade.max_score:g} "
            f'<span class="status">{_esc(grade.status, 40)}</span></h2>')
    parts = [head]
    if grade.submitted_at:
        late = (f"{grade.days_late} day(s) late: {grade.late_penalty:g} points taken off (already in the score "
                "above)" if grade.days_late else "on time")
        parts.append(f'<p class="late">Submitted {_esc(grade.submitted_at, 40)}: {late}.</p>')
    if grade.status != GRADED:
        parts.append(f"<p>{_esc(grade.detail)}</p>")
    if grade.results:
        rows = "".join(_check_row(r) for r in grade.results)
        parts.append(f"<table><tr><th>check</th><th>points</th><th>result</th><th>what to fix</th></tr>"
                     f"{rows}</table>")
    return "\n".join(parts)


def student_html(student: str, grades: Sequence[Grade]) -> str:
    """The feedback page of `student` over all their graded notebooks."""
    total, possible = sum(g.score for g in grades), sum(g.max_score for g in grades)
    body = "\n".join(_notebook_section(g) for g in grades)
    who = _esc(student, 300)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>labkit feedback: {who}"
            f"</title><style>{_CSS}</style></head><body><h1>Feedback for {who}</h1>"
            f"<p>Total: {total:g} / {possible:g}. Hidden checks are named with their result only.</p>"
            f"{body}</body></html>\n")


def write_feedback(rows: Sequence[Grade], directory: Path, file_name) -> list[str]:
    """`directory/<file_name(student)>.html` for every student in `rows`, each on its own; the problems (a page
    replaced by a short one, or not written), one line each."""
    directory.mkdir(parents=True, exist_ok=True)
    by_student: dict[str, list[Grade]] = {}
    for row in rows:
        by_student.setdefault(row.student, []).append(row)
    problems = []
    for student, grades in sorted(by_student.items()):
        try:
            path = directory / f"{file_name(student)}.html"
        except Exception as exc:  # noqa: BLE001 - a name no file can have
            problems.append(f"no feedback page for {clean(student, 80)!r}: {type(exc).__name__}")
            continue
        try:
            page = student_html(student, grades)
        except Exception as exc:  # noqa: BLE001 - this page only
            problems.append(f"feedback for {clean(student, 80)!r} could not be rendered ({type(exc).__name__}); a "
                            "short page says so")
            page = (f"<!DOCTYPE html>\n<html><body><h1>Feedback for {_esc(student, 300)}</h1><p>Your grades are "
                    "recorded; this page could not be rendered. Ask your instructor for the details.</p></body></html>\n")
        try:
            path.write_text(page, encoding="utf-8")
        except OSError as exc:
            problems.append(f"feedback for {clean(student, 80)!r} not written: {exc.strerror}")
    return problems
