"""The late policy of `labkit grade --deadline` (issue #40 item 6).

A submission is due at the deadline plus its student's extension (the roster's `extension`, in days). Its
time comes from, in this order:

1. `<student>/submission_metadata.json`, Gradescope's file (its `created_at`, an ISO time with an offset);
2. `SUBMISSIONS_DIR/received.csv`, a list the course keeps (`student,submitted_at` or
   `student,notebook,submitted_at`; a line without a notebook covers all of the student's);
3. the notebook file's modification time (what an LMS export or a copy preserved; anyone can change it).

A row `days_late` days late (started days: one minute late is one day) keeps `1 - min(days x per_day, cap)`
of its points; the row's detail, grades.csv (`submitted_at, days_late, late_penalty`) and the feedback page
say so. A time is only as trustworthy as the folder it comes from: keep the LMS's or Gradescope's own export.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

from labkit.errors import ConfigError

METADATA = "submission_metadata.json"
RECEIVED = "received.csv"
COLUMNS = ("submitted_at", "days_late", "late_penalty")


def parse_time(text: str, what: str = "--deadline") -> datetime:
    """An ISO time (`2026-12-01T23:59`, `2026-12-01 23:59-05:00`, `...Z`); without an offset it is UTC."""
    try:
        when = datetime.fromisoformat(str(text).strip().replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"{what} {text!r} is not a time; give an ISO time such as 2026-12-01T23:59 (UTC) or "
                          "2026-12-01T23:59-05:00") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)


def stamp(when: datetime) -> str:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class LatePolicy:
    deadline: str
    """ISO time; without an offset, UTC."""
    per_day: float = 10.0
    """Percent of a row's points lost per started day late."""
    cap: float = 100.0
    """Most percent a row can lose."""

    def __post_init__(self) -> None:
        parse_time(self.deadline)
        for name, value in (("--late-penalty", self.per_day), ("--late-cap", self.cap)):
            if not isinstance(value, (int, float)) or not 0 <= value <= 100 or not math.isfinite(value):
                raise ConfigError(f"{name} {value!r}; give a percent between 0 and 100")

    def due(self, extension_days: float = 0.0) -> datetime:
        return parse_time(self.deadline) + timedelta(days=extension_days)

    def days_late(self, submitted: datetime, extension_days: float = 0.0) -> int:
        late = (submitted - self.due(extension_days)).total_seconds()
        return max(0, math.ceil(late / 86400))

    def fraction_lost(self, days: int) -> float:
        return min(days * self.per_day, self.cap) / 100.0


def _metadata_time(folder: Path) -> datetime | None:
    from labkit.course.grading.evaluate import SubmissionProblem, read_submitted

    try:
        data = json.loads(read_submitted(folder / METADATA, 2**20).decode("utf-8"))
        return parse_time(data["created_at"], METADATA)
    except (SubmissionProblem, ValueError, KeyError, TypeError, ConfigError):
        return None


def _received(root: Path) -> dict[tuple[str, str], datetime]:
    from labkit.course.grading.evaluate import SubmissionProblem, read_submitted

    try:
        lines = list(csv.reader(read_submitted(root / RECEIVED, 16 * 2**20).decode("utf-8").splitlines()))
    except (SubmissionProblem, UnicodeDecodeError, csv.Error):
        return {}
    out = {}
    for line in lines[1:]:
        if len(line) == 2:
            student, notebook, when = line[0], "", line[1]
        elif len(line) >= 3:
            student, notebook, when = line[:3]
        else:
            continue
        try:
            out[(student.strip(), notebook.strip())] = parse_time(when, RECEIVED)
        except ConfigError:
            continue
    return out


def submission_times(root: Path, subs, mtimes: dict[tuple[str, str], float]) -> dict[tuple[str, str],
                                                                                    tuple[datetime, str]]:
    """(time, source) of every submission in `subs` that has one: Gradescope's metadata, received.csv, the
    file's mtime (`mtimes`, taken when it was read)."""
    listed = _received(root)
    out: dict[tuple[str, str], tuple[datetime, str]] = {}
    meta: dict[str, datetime | None] = {}
    for sub in subs:
        key = (sub.student, sub.notebook)
        if sub.student not in meta:
            meta[sub.student] = _metadata_time(root / sub.student) if not sub.problem else None
        if meta[sub.student] is not None:
            out[key] = (meta[sub.student], METADATA)
        elif key in listed or (sub.student, "") in listed:
            out[key] = (listed.get(key) or listed[(sub.student, "")], RECEIVED)
        elif key in mtimes:
            out[key] = (datetime.fromtimestamp(mtimes[key], timezone.utc), "file time")
    return out


def apply(rows, policy: LatePolicy, times, roster=None):
    """`rows` with submitted_at / days_late / late_penalty set and the penalty taken from their score."""
    out = []
    for row in rows:
        found = times.get((row.student, row.notebook))
        if found is None:
            out.append(row)
            continue
        when, source = found
        student = roster.find(row.student) if roster is not None else None
        extension = student.extension_days if student is not None else 0.0
        days = policy.days_late(when, extension)
        lost = round(row.score * policy.fraction_lost(days), 6)
        note = ""
        if days:
            due = stamp(policy.due(extension)) + (f" with a {extension:g}-day extension" if extension else "")
            note = (f"late: submitted {stamp(when)} ({source}), due {due}: {days} day(s) late, "
                    f"-{policy.fraction_lost(days) * 100:g}% = -{lost:g} points")
        out.append(replace(row, score=row.score - lost, submitted_at=stamp(when), days_late=days, late_penalty=lost,
                           detail="; ".join(filter(None, (row.detail, note)))))
    return out
