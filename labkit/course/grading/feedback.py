"""One self-contained HTML feedback page per student.

Each check is named with its points and pass/fail; a visible check also shows its message (what to fix).
A hidden check shows only its name and pass/fail: never its message, code or expected values. Every
string from a submission is HTML-escaped.
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Sequence

from labkit.course.grading.checks import CheckResult
from labkit.course.grading.evaluate import GRADED, Grade

_CSS = """body{font-family:system-ui,sans-serif;max-width:56rem;margin:2rem auto;padding:0 1rem;color:#222}
table{border-collapse:collapse;width:100%;margin:.5rem 0 1.5rem}td,th{border:1px solid #ccc;padding:.3rem .5rem;
text-align:left;vertical-align:top}.pass{color:#176b1a;font-weight:600}.fail{color:#a31515;font-weight:600}
.status{padding:.1rem .4rem;border-radius:.3rem;background:#eee}.hidden{color:#666;font-style:italic}"""


def _check_row(result: CheckResult) -> str:
    verdict = '<span class="pass">pass</span>' if result.passed else '<span class="fail">fail</span>'
    if result.visible:
        name, message = html.escape(result.name), html.escape(result.message)
    else:
        name, message = f'{html.escape(result.name)} <span class="hidden">(hidden)</span>', ""
    return (f"<tr><td>{name}</td><td>{result.earned:g} / {result.points:g}</td><td>{verdict}</td>"
            f"<td>{message}</td></tr>")


def _notebook_section(grade: Grade) -> str:
    head = (f"<h2>{html.escape(grade.notebook or '(no notebook)')}: {grade.score:g} / {grade.max_score:g} "
            f'<span class="status">{html.escape(grade.status)}</span></h2>')
    parts = [head]
    if grade.status != GRADED:
        parts.append(f"<p>{html.escape(grade.detail)}</p>")
    if grade.results:
        rows = "".join(_check_row(r) for r in grade.results)
        parts.append(f"<table><tr><th>check</th><th>points</th><th>result</th><th>what to fix</th></tr>"
                     f"{rows}</table>")
    return "\n".join(parts)


def student_html(student: str, grades: Sequence[Grade]) -> str:
    """The feedback page of `student` over all their graded notebooks."""
    total, possible = sum(g.score for g in grades), sum(g.max_score for g in grades)
    body = "\n".join(_notebook_section(g) for g in grades)
    who = html.escape(student)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>labkit feedback: {who}"
            f"</title><style>{_CSS}</style></head><body><h1>Feedback for {who}</h1>"
            f"<p>Total: {total:g} / {possible:g}. Hidden checks are named with their result only.</p>"
            f"{body}</body></html>\n")


def write_feedback(rows: Sequence[Grade], directory: Path, file_name) -> list[Path]:
    """`directory/<file_name(student)>.html` for every student in `rows`."""
    directory.mkdir(parents=True, exist_ok=True)
    by_student: dict[str, list[Grade]] = {}
    for row in rows:
        by_student.setdefault(row.student, []).append(row)
    paths = []
    for student, grades in sorted(by_student.items()):
        path = directory / f"{file_name(student)}.html"
        path.write_text(student_html(student, grades), encoding="utf-8")
        paths.append(path)
    return paths
