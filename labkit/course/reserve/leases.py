"""Leases as data: the `user,node,start,end` CSV that `labkit reserve check` reads and `plan` writes.

Times are ISO 8601 with a UTC offset (`2025-02-21T14:00:00-05:00` or `...Z`). A row that cannot be
understood becomes a `Row` with `problem` set, so the checker reports it as `malformed` and still
checks the others.
"""
from __future__ import annotations

import csv
import datetime as dt
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from labkit.errors import ReservationError

COLUMNS = ("user", "node", "start", "end")


@dataclass(frozen=True)
class Lease:
    """One booked block on one node; `start`/`end` are timezone-aware."""

    user: str
    node: str
    start: dt.datetime
    end: dt.datetime
    row: int = 0
    """Line number in the source file (0 when not read from a file)."""

    def __post_init__(self) -> None:
        if self.start.tzinfo is None or self.end.tzinfo is None:
            raise ReservationError(f"lease of {self.user!r} on {self.node!r} has a naive time; "
                                   f"give start and end with a UTC offset")

    @property
    def hours(self) -> float:
        return (self.end - self.start).total_seconds() / 3600

    def overlaps(self, other: "Lease") -> bool:
        return self.start < other.end and other.start < self.end


@dataclass(frozen=True)
class Row:
    """One CSV row as written, with the parsed `lease` or the reason it could not be parsed."""

    user: str
    node: str
    start: str
    end: str
    row: int
    lease: Lease | None = None
    problem: str = ""


def parse_time(text: str, *, tz_hint=None, field: str = "time") -> dt.datetime:
    """Aware datetime from ISO 8601 text with a UTC offset; naive or garbled text is an error
    whose message shows the fix (with `tz_hint`, the same wall-clock time with that zone's offset)."""
    text = (text or "").strip()
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError as exc:
        raise ReservationError(f"{field} {text!r} is not an ISO 8601 date-time; write it like "
                               f"2025-02-21T14:00:00-05:00") from exc
    if when.tzinfo is None:
        fix = when.replace(tzinfo=tz_hint).isoformat() if tz_hint else text + "-05:00"
        raise ReservationError(f"{field} {text!r} has no UTC offset, so it is ambiguous; add one, "
                               f"e.g. {fix}" + (f" ({tz_hint.key})" if tz_hint else ""))
    return when


def parse_row(values: dict, row: int, *, tz_hint=None) -> Row:
    """A `Row` from one csv.DictReader record (missing fields and bad times become `problem`)."""
    fields = {k: (values.get(k) or "").strip() for k in COLUMNS}
    base = dict(**fields, row=row)
    if values.get(None):
        return Row(**base, problem=f"row {row} has {len(values[None])} extra field(s); "
                                   f"expected exactly the columns {','.join(COLUMNS)} (quote commas)")
    missing = [k for k in COLUMNS if not fields[k]]
    if missing:
        return Row(**base, problem=f"row {row} is missing {', '.join(missing)}; "
                                   f"every row needs {','.join(COLUMNS)}")
    try:
        start = parse_time(fields["start"], tz_hint=tz_hint, field="start")
        end = parse_time(fields["end"], tz_hint=tz_hint, field="end")
    except ReservationError as exc:
        return Row(**base, problem=f"row {row}: {exc}")
    if end <= start:
        return Row(**base, problem=f"row {row}: end {fields['end']} is not after start {fields['start']}; "
                                   f"swap them or fix the date")
    return Row(**base, lease=Lease(fields["user"], fields["node"], start, end, row))


def read_rows(path: str | Path, *, tz_hint=None) -> list[Row]:
    """All rows of a leases CSV. Raises `ReservationError` only when the file cannot be read at all
    (missing, not UTF-8 text, no header with the required columns)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ReservationError(f"cannot read leases file {path}: {reason}; give a UTF-8 CSV with "
                               f"columns {','.join(COLUMNS)}") from exc
    return rows_from_text(text, source=str(path), tz_hint=tz_hint)


def rows_from_text(text: str, *, source: str = "<text>", tz_hint=None) -> list[Row]:
    reader = csv.DictReader(io.StringIO(text))
    header = [h.strip() for h in (reader.fieldnames or [])]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise ReservationError(f"{source} has no column(s) {', '.join(missing)} in its header "
                               f"{header or '(empty file)'}; the first line must be {','.join(COLUMNS)}")
    reader.fieldnames = header
    try:
        return [parse_row(values, reader.line_num, tz_hint=tz_hint) for values in reader]
    except csv.Error as exc:
        raise ReservationError(f"{source} is not a readable CSV: {exc}") from exc


def write_leases(leases: Iterable[Lease], path: str | Path | None = None, *, tz=None) -> str:
    """CSV text (and the file, if `path`) with times shown in `tz` (default: their own offset)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for lease in leases:
        start, end = (t.astimezone(tz) if tz else t for t in (lease.start, lease.end))
        writer.writerow([lease.user, lease.node, start.isoformat(), end.isoformat()])
    if path is not None:
        Path(path).write_text(out.getvalue(), encoding="utf-8")
    return out.getvalue()
