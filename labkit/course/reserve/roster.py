"""The class roster for `labkit reserve plan`: who needs a block, and when each student cannot come.

A CSV with a header and the columns `user,unavailable` (other columns are ignored). `unavailable`
holds zero or more entries separated by `;`, each one of:

    2025-02-20                            that whole day
    2025-02-20/2025-02-22                 those whole days (the end day included)
    2025-02-20T18:00/2025-02-20T22:00     a time range (no UTC offset = the course's time zone)
    Mon-Fri 09:00-17:00                   every such weekday, those hours (course time)
    Sat   or   Sat-Sun                    every such weekday, all day

See `reservations/README.md`. A bad entry is an error naming the row and the entry.
"""
from __future__ import annotations

import csv
import datetime as dt
import io
import re
from dataclasses import dataclass
from pathlib import Path

from labkit.errors import ReservationError

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_WEEKLY = re.compile(r"^(?P<d0>[A-Za-z]{3})(?:-(?P<d1>[A-Za-z]{3}))?"
                     r"(?:\s+(?P<t0>\d{1,2}:\d{2})-(?P<t1>\d{1,2}:\d{2}))?$")
_FORMS = ("2025-02-20", "2025-02-20/2025-02-22", "2025-02-20T18:00/2025-02-20T22:00",
          "Mon-Fri 09:00-17:00", "Sat-Sun")


@dataclass(frozen=True)
class Weekly:
    """Every `days` (0 = Monday), from `start` to `end` (course time); `end` None = midnight."""

    days: frozenset[int]
    start: dt.time
    end: dt.time | None


@dataclass(frozen=True)
class Student:
    user: str
    ranges: tuple[tuple[dt.datetime, dt.datetime], ...] = ()
    """Aware [start, end) intervals when the student cannot have a block."""
    weekly: tuple[Weekly, ...] = ()

    def free(self, start: dt.datetime, end: dt.datetime, tz) -> bool:
        """True when [start, end) touches none of the student's unavailable times."""
        if any(s < end and start < e for s, e in self.ranges):
            return False
        day, last = start.astimezone(tz).date(), end.astimezone(tz).date()
        while day <= last:
            for rule in self.weekly:
                if day.weekday() in rule.days:
                    s = dt.datetime.combine(day, rule.start, tzinfo=tz)
                    e = (dt.datetime.combine(day + dt.timedelta(days=1), dt.time(0), tzinfo=tz)
                         if rule.end is None else dt.datetime.combine(day, rule.end, tzinfo=tz))
                    if s < end and start < e:
                        return False
            day += dt.timedelta(days=1)
        return True


def read_roster(path: str | Path, tz) -> list[Student]:
    """Students in file order; raises `ReservationError` for an unreadable file or a bad entry."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ReservationError(f"cannot read roster {path}: {getattr(exc, 'strerror', None) or exc}; "
                               f"give a UTF-8 CSV with columns user,unavailable") from exc
    return roster_from_text(text, tz, source=str(path))


def roster_from_text(text: str, tz, *, source: str = "<roster>") -> list[Student]:
    reader = csv.DictReader(io.StringIO(text))
    header = [h.strip() for h in (reader.fieldnames or [])]
    if "user" not in header:
        raise ReservationError(f"{source}: the header {header or '(empty file)'} has no 'user' column; "
                               f"the first line must be user,unavailable")
    reader.fieldnames = header
    students, seen = [], set()
    for values in reader:
        user = (values.get("user") or "").strip()
        where = f"{source} row {reader.line_num}"
        if not user:
            raise ReservationError(f"{where} has an empty user; fill it in or delete the row")
        if user in seen:
            raise ReservationError(f"{where}: user {user!r} appears twice; merge the rows (join the "
                                   f"unavailable entries with ';')")
        seen.add(user)
        students.append(parse_student(user, values.get("unavailable") or "", tz, where=where))
    return students


def parse_student(user: str, unavailable: str, tz, *, where: str = "roster") -> Student:
    ranges, weekly = [], []
    for entry in (e.strip() for e in unavailable.split(";")):
        if not entry:
            continue
        try:
            rule = _weekly(entry)
            if rule is not None:
                weekly.append(rule)
            else:
                ranges.append(_range(entry, tz))
        except ValueError as exc:
            raise ReservationError(f"{where}: unavailable entry {entry!r} for {user!r} is not understood "
                                   f"({exc}); use forms like {'; '.join(_FORMS)}") from exc
    return Student(user, tuple(ranges), tuple(weekly))


def _weekly(entry: str) -> Weekly | None:
    match = _WEEKLY.match(entry)
    if match is None:
        return None
    d0, d1 = (match[k].lower() if match[k] else None for k in ("d0", "d1"))
    if d0 not in DAYS or (d1 is not None and d1 not in DAYS):
        raise ValueError(f"weekdays are {', '.join(d.title() for d in DAYS)}")
    i0, i1 = DAYS.index(d0), DAYS.index(d1 or d0)
    days = frozenset((i0 + k) % 7 for k in range((i1 - i0) % 7 + 1))
    if match["t0"] is None:
        return Weekly(days, dt.time(0), None)
    t0, t1 = (dt.time.fromisoformat(match[k].zfill(5)) for k in ("t0", "t1"))
    if not t0 < t1:
        raise ValueError("the start time must be before the end time")
    return Weekly(days, t0, t1)


def _range(entry: str, tz) -> tuple[dt.datetime, dt.datetime]:
    first, _, second = entry.partition("/")
    start = _point(first, tz, end=False)
    end = _point(second or first, tz, end=True)
    if not start < end:
        raise ValueError("the range ends before it starts")
    return start, end


def _point(text: str, tz, *, end: bool) -> dt.datetime:
    text = text.strip()
    if len(text) == 10:  # a date: the whole day, so an end date means the following midnight
        day = dt.date.fromisoformat(text) + dt.timedelta(days=1 if end else 0)
        return dt.datetime.combine(day, dt.time(0), tzinfo=tz)
    when = dt.datetime.fromisoformat(text)
    return when.replace(tzinfo=tz) if when.tzinfo is None else when
