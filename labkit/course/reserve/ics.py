"""A minimal RFC 5545 (iCalendar) writer for the reservation schedule.

Written by hand, not with a library, because it is small: CRLF line endings (RFC 5545 3.1),
content lines folded at 75 octets without splitting a UTF-8 character (3.1), TEXT values escaped
(3.3.11), every VEVENT with UID and DTSTAMP (3.6.1), and DTSTART/DTEND in UTC form with a
trailing Z (3.3.5, "FORM #2").
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

CRLF = "\r\n"
LIMIT = 75  # octets per physical line, CRLF excluded (RFC 5545 3.1)


@dataclass(frozen=True)
class Event:
    uid: str
    start: dt.datetime
    end: dt.datetime
    summary: str
    description: str = ""
    location: str = ""
    categories: tuple[str, ...] = ()
    extra: tuple[tuple[str, str], ...] = field(default=())
    """Additional (NAME, text) properties, e.g. ("X-LABKIT-USER", "alice")."""


def utc_stamp(when: dt.datetime) -> str:
    """DATE-TIME in UTC form, e.g. 20250214T190000Z; naive datetimes are refused."""
    if when.tzinfo is None:
        raise ValueError(f"{when!r} is naive; iCalendar UTC times need an aware datetime")
    return when.astimezone(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def escape(text: str) -> str:
    """TEXT value escaping: backslash, semicolon, comma and newlines (RFC 5545 3.3.11)."""
    return (text.replace("\\", "\\\\").replace(";", "\\;").replace(",", "\\,")
            .replace("\r\n", "\\n").replace("\n", "\\n"))


def fold(line: str) -> str:
    """Fold one content line into physical lines of at most 75 octets, each continuation starting
    with one space; cuts fall between UTF-8 characters, never inside one."""
    parts, current, size = [], [], 0
    for char in line:
        width = len(char.encode("utf-8"))
        budget = LIMIT if not parts else LIMIT - 1  # continuation lines spend one octet on the space
        if size + width > budget:
            parts.append("".join(current))
            current, size = [], 0
        current.append(char)
        size += width
    parts.append("".join(current))
    return CRLF.join(parts[:1] + [" " + p for p in parts[1:]])


def _event_lines(event: Event, dtstamp: str) -> list[str]:
    lines = ["BEGIN:VEVENT", f"UID:{escape(event.uid)}", f"DTSTAMP:{dtstamp}",
             f"DTSTART:{utc_stamp(event.start)}", f"DTEND:{utc_stamp(event.end)}",
             f"SUMMARY:{escape(event.summary)}"]
    if event.description:
        lines.append(f"DESCRIPTION:{escape(event.description)}")
    if event.location:
        lines.append(f"LOCATION:{escape(event.location)}")
    if event.categories:
        lines.append("CATEGORIES:" + ",".join(escape(c) for c in event.categories))
    lines += [f"{name}:{escape(value)}" for name, value in event.extra]
    lines += ["TRANSP:OPAQUE", "END:VEVENT"]
    return lines


def calendar(events: list[Event], *, name: str = "labkit reservations",
             stamp: dt.datetime | None = None) -> str:
    """The whole VCALENDAR as text with CRLF endings; `stamp` (default now) becomes every DTSTAMP."""
    dtstamp = utc_stamp(stamp or dt.datetime.now(dt.timezone.utc))
    lines = ["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//labkit//labkit reserve plan//EN",
             "CALSCALE:GREGORIAN", "METHOD:PUBLISH", f"X-WR-CALNAME:{escape(name)}"]
    for event in events:
        lines += _event_lines(event, dtstamp)
    lines.append("END:VCALENDAR")
    return CRLF.join(fold(line) for line in lines) + CRLF
