"""Gradebook files written by `labkit grade`: grades.csv, summary.csv, and LMS import layouts.

- `grades.csv`: student,notebook,score,max_score,status,detail (one row per submission);
- `summary.csv`: per notebook, the count of each status and the mean score;
- `canvas.csv`: Canvas gradebook import (Student, ID, SIS User ID, SIS Login ID, Section, one column per
  notebook, a 'Points Possible' row); the student directory name goes in 'SIS Login ID';
- `gradescope/<notebook>.csv`: Gradescope score upload (Name, SID, Email, Score); the directory name is
  the SID, and the Email too when it looks like one.
"""
from __future__ import annotations

import csv
import hashlib
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from labkit.course.grading.evaluate import STATUSES, Grade

GRADES_COLUMNS = ("student", "notebook", "score", "max_score", "status", "detail")
CANVAS_ID_COLUMNS = ("Student", "ID", "SIS User ID", "SIS Login ID", "Section")


def safe_name(name: str) -> str:
    """A unique file name for `name` (student directories and notebook names come from anyone)."""
    safe = re.sub(r"[^A-Za-z0-9._@-]", "_", name).lstrip(".") or "_"
    return safe if safe == name else f"{safe}-{hashlib.sha1(name.encode()).hexdigest()[:6]}"


def _text(value: Any) -> str:
    """A CSV field a spreadsheet will not execute (student-controlled text may start with '=')."""
    text = str(value).replace("\r", " ").replace("\n", " ")
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t") else text


def _num(value: float) -> str:
    return f"{value:g}"


def _write(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_grades(rows: Sequence[Grade], path: Path) -> Path:
    return _write(path, GRADES_COLUMNS, ([_text(r.student), _text(r.notebook), _num(r.score),
                                          _num(r.max_score), r.status, _text(r.detail)] for r in rows))


def summary(rows: Sequence[Grade]) -> list[dict[str, Any]]:
    """Per notebook: submissions, the count of each status, mean and max score."""
    by_nb: dict[str, list[Grade]] = defaultdict(list)
    for row in rows:
        by_nb[row.notebook or "(none)"].append(row)
    out = []
    for notebook, group in sorted(by_nb.items()):
        counts = Counter(r.status for r in group)
        out.append({"notebook": notebook, "submissions": len(group), **{s: counts.get(s, 0) for s in STATUSES},
                    "mean_score": round(sum(r.score for r in group) / len(group), 2),
                    "max_score": max(r.max_score for r in group)})
    return out


def write_summary(rows: Sequence[Grade], path: Path) -> Path:
    table = summary(rows)
    cols = list(table[0]) if table else ["notebook", "submissions", *STATUSES, "mean_score", "max_score"]
    return _write(path, cols, ([_text(row[c]) if c == "notebook" else row[c] for c in cols] for row in table))


def write_canvas(rows: Sequence[Grade], path: Path) -> Path:
    notebooks = sorted({r.notebook for r in rows if r.notebook})
    students = sorted({r.student for r in rows})
    score = {(r.student, r.notebook): r.score for r in rows}
    maxima = {r.notebook: r.max_score for r in rows}
    lines = [["Points Possible", "", "", "", "", *(_num(maxima[n]) for n in notebooks)]]
    for s in students:
        lines.append([_text(s), "", "", _text(s), "",
                      *(_num(score[(s, n)]) if (s, n) in score else "" for n in notebooks)])
    return _write(path, [*CANVAS_ID_COLUMNS, *notebooks], lines)


def write_gradescope(rows: Sequence[Grade], directory: Path) -> list[Path]:
    paths = []
    for notebook in sorted({r.notebook for r in rows if r.notebook}):
        group = [r for r in rows if r.notebook == notebook]
        lines = ([_text(r.student), _text(r.student), _text(r.student) if "@" in r.student else "", _num(r.score)]
                 for r in group)
        paths.append(_write(directory / f"{safe_name(notebook)}.csv", ("Name", "SID", "Email", "Score"), lines))
    return paths
