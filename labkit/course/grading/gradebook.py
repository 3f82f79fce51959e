"""Gradebook files written by `labkit grade`: grades.csv, summary.csv, and LMS import layouts.

- `grades.csv`: student,notebook,score,max_score,status,detail (one row per submission), then the points of
  each question of the plan (labkit.course.grading.questions);
- `summary.csv`: per notebook, the count of each status and the mean score;
- `canvas.csv`: Canvas gradebook import (Student, ID, SIS User ID, SIS Login ID, Section, one column per
  notebook, a 'Points Possible' row); the student directory name goes in 'SIS Login ID';
- `gradescope/<notebook>.csv`: Gradescope score upload (Name, SID, Email, Score); the directory name is
  the SID, and the Email too when it looks like one (with a roster: its name, id and email);
- `unrostered.csv` (with a roster): the folders no roster line claims.

File names in OUT_DIR are unique within a batch (`file_names`): a collision gets a suffix and a warning.

Every file is a function of the rows and the grader's plan (`maxima`: the points possible per notebook, never
taken from a submission), so the rows of several grading runs (shards) merge into one gradebook. `write_all`
writes each file on its own: a row that breaks one file never stops the others, and every text field a
submission can influence goes through `clean` (any value becomes printable UTF-8 of bounded length).
"""
from __future__ import annotations

import csv
import hashlib
import re
from collections import Counter, defaultdict
from pathlib import Path
from dataclasses import replace
from typing import Any, Iterable, Sequence

from labkit.course.grading.evaluate import STATUSES, Grade
from labkit.course.grading.questions import earned
from labkit.course.grading.text import clean
from labkit.course.grading.text import csv_field as _text

GRADES_COLUMNS = ("student", "notebook", "score", "max_score", "status", "detail")
CANVAS_ID_COLUMNS = ("Student", "ID", "SIS User ID", "SIS Login ID", "Section")
LATE_COLUMNS = ("submitted_at", "days_late", "late_penalty")
def normalize(rows: Sequence[Grade], maxima: dict[str, float]) -> list[Grade]:
    """Every row out of the plan's maximum for its notebook (`maxima`), its score within [0, that maximum]:
    nothing a submission made of its row changes what is possible, for it or for anyone else."""
    out = []
    for row in rows:
        most = float(maxima.get(row.notebook, row.max_score))
        score = min(max(float(row.score), 0.0), most)
        note = "" if score == row.score else f"; score {row.score:g} outside [0, {most:g}]: clamped (please report it)"
        out.append(replace(row, score=score, max_score=most, detail=row.detail + note))
    return out


_HASHED = re.compile(r"-[0-9a-f]{6}$")


def safe_name(name: str) -> str:
    """A file name for `name` (student directories and notebook names come from anyone): the name itself when it
    is safe, else its safe characters and a hash of it. A safe name that looks hashed (`alice_smith-b6a89e`) is
    hashed too, so it never meets the name of `alice smith`; `file_names` settles what a hash cannot."""
    safe = re.sub(r"[^A-Za-z0-9._@-]", "_", name).lstrip(".") or "_"
    if safe == name and not _HASHED.search(name):
        return safe
    # surrogatepass: a directory name that is not UTF-8 (os.listdir's surrogateescape) still hashes
    return f"{safe[:100]}-{hashlib.sha1(name.encode('utf-8', 'surrogatepass')).hexdigest()[:6]}"


def file_names(names: Iterable[str], base=safe_name) -> tuple[dict[str, str], list[str]]:
    """One file name per name, unique within the batch even on a case-insensitive disk: `base(name)`, and on a
    collision (a crafted hash, `Alice` beside `alice`) the later name in sorted order gets `~2`, `~3`...; the
    warnings say which. Deterministic: the same names always get the same files (a merge equals one machine)."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    warnings = []
    for name in sorted(set(names)):
        first = candidate = base(name)
        n = 1
        while candidate.casefold() in taken:
            n += 1
            candidate = f"{first}~{n}"
        if candidate != first:
            owner = next(k for k, v in out.items() if v.casefold() == first.casefold())
            warnings.append(f"{clean(name, 80)!r} and {clean(owner, 80)!r} map to the same file name {first!r}: "
                            f"{clean(name, 80)!r} is written as {candidate!r}")
        taken.add(candidate.casefold())
        out[name] = candidate
    return out, warnings


def _num(value: float) -> str:
    return f"{value:g}"


def _write(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_grades(rows: Sequence[Grade], path: Path, questions: Sequence = ()) -> Path:
    """grades.csv: the GRADES_COLUMNS, under a deadline `submitted_at, days_late, late_penalty`
    (labkit.course.grading.late), then the points of each question (labkit.course.grading.questions)."""
    timed = any(r.submitted_at for r in rows)

    def late(r: Grade) -> list[str]:
        return [_text(r.submitted_at), str(r.days_late) if r.submitted_at else "",
                _num(r.late_penalty) if r.submitted_at else ""] if timed else []

    return _write(path, [*GRADES_COLUMNS, *(LATE_COLUMNS if timed else ()), *(_text(q.header) for q in questions)],
                  ([_text(r.student), _text(r.notebook), _num(r.score), _num(r.max_score), r.status,
                    _text("; ".join(filter(None, (r.detail, r.review)))), *late(r), *earned(r, questions)]
                   for r in rows))


def summary(rows: Sequence[Grade]) -> list[dict[str, Any]]:
    """Per notebook: submissions, the count of each status, mean and max score (rows normalized first)."""
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


def _who(student: str, roster) -> tuple[str, str, str]:
    """(name, id, email) of a folder for the exports: the roster's when it lists the student, else the folder's."""
    found = roster.find(student) if roster is not None else None
    if found is not None:
        return found.name or student, found.id, found.email
    return student, student, student if "@" in student else ""


def write_canvas(rows: Sequence[Grade], path: Path, maxima: dict[str, float], roster=None,
                 questions: Sequence = ()) -> Path:
    """canvas.csv; 'Points Possible' is the plan's maximum of each notebook (the roster names the students), then
    of each question in `questions` (--export-questions)."""
    notebooks = sorted({r.notebook for r in rows if r.notebook})
    students = sorted({r.student for r in rows})
    by_key = {(r.student, r.notebook): r for r in rows}
    lines = [["Points Possible", "", "", "", "", *(_num(maxima.get(n, 0.0)) for n in notebooks),
              *(_num(q.points) for q in questions)]]
    for s in students:
        name, sid, _ = _who(s, roster)
        per_question = [""] * len(questions)
        for n in notebooks:
            if (s, n) in by_key:
                per_question = [a or b for a, b in zip(per_question, earned(by_key[(s, n)], questions))]
        lines.append([_text(name), "", _text(sid) if roster is not None else "", _text(s), "",
                      *(_num(by_key[(s, n)].score) if (s, n) in by_key else "" for n in notebooks), *per_question])
    # a notebook's name is a file's: escaped like any other field
    return _write(path, [*CANVAS_ID_COLUMNS, *map(_text, notebooks), *(_text(q.header) for q in questions)], lines)


def write_gradescope(rows: Sequence[Grade], directory: Path, roster=None, questions: Sequence = ()) -> list[Path]:
    paths = []
    names, _ = file_names({r.notebook for r in rows if r.notebook})
    for notebook in sorted(names):
        group = [r for r in rows if r.notebook == notebook]
        mine = [q for q in questions if q.notebook == notebook]
        lines = ([*map(_text, _who(r.student, roster)), _num(r.score), *earned(r, mine)] for r in group)
        paths.append(_write(directory / f"{names[notebook]}.csv",
                            ("Name", "SID", "Email", "Score", *(_text(q.header) for q in mine)), lines))
    return paths


def write_unrostered(rows: Sequence[Grade], path: Path, roster) -> list[str]:
    """unrostered.csv (folder, notebooks): the graded folders no roster line claims; one warning each."""
    folders: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        if roster.find(r.student) is None:
            folders[r.student].append(r.notebook)
    _write(path, ("folder", "notebooks"), ([_text(f), _text(" ".join(filter(None, nbs)))]
                                           for f, nbs in sorted(folders.items())))
    return [f"the folder {clean(f, 80)!r} is on no line of the roster (graded; unrostered.csv)"
            for f in sorted(folders)]


def write_all(rows: Sequence[Grade], maxima: dict[str, float], out_dir: Path, file_name=safe_name,
              pairs: Sequence = (), roster=None, questions: Sequence = (), export_questions: bool = False,
              code_pairs: Sequence = ()) -> list[str]:
    """Write grades.csv (first: an OSError there is the caller's), then summary.csv, canvas.csv, gradescope/,
    review.csv, review/, report.html, manual.json, unrostered.csv and feedback/, each on its own; the problems of
    those that failed, one line each."""
    from labkit.course.grading import copies, feedback, manual, report, similarity

    rows = normalize(rows, maxima)
    write_grades(rows, out_dir / "grades.csv", questions)
    exported = questions if export_questions else ()
    writers = {"summary.csv": lambda: write_summary(rows, out_dir / "summary.csv"),
               "canvas.csv": lambda: write_canvas(rows, out_dir / "canvas.csv", maxima, roster, exported),
               "gradescope/": lambda: write_gradescope(rows, out_dir / "gradescope", roster, exported),
               "review.csv": lambda: copies.write_review(list(pairs), out_dir / "review.csv", code_pairs),
               "review/": lambda: problems.extend(similarity.write_pages(code_pairs, out_dir)),
               "report.html": lambda: report.write(rows, maxima, out_dir / "report.html")}
    problems: list[str] = []
    for name, write in writers.items():
        try:
            write()
        except Exception as exc:  # noqa: BLE001 - one file's failure never costs the others
            problems.append(f"{name} not written: {type(exc).__name__}: {clean(exc, 200)}")
    try:
        manual.write_answers(rows, out_dir)
    except OSError as exc:
        problems.append(f"manual.json not written: {exc.strerror}")
    if roster is not None:
        try:
            problems += write_unrostered(rows, out_dir / "unrostered.csv", roster)
        except Exception as exc:  # noqa: BLE001 - as above
            problems.append(f"unrostered.csv not written: {type(exc).__name__}: {clean(exc, 200)}")
    names, collisions = file_names({r.student for r in rows}, file_name)
    _, clashing = file_names({r.notebook for r in rows if r.notebook})
    problems += [f"feedback/: {w}" for w in collisions] + [f"gradescope/: {w}" for w in clashing]
    return problems + feedback.write_feedback(rows, out_dir / "feedback", names.__getitem__)
