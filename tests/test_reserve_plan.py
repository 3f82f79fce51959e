"""labkit.course.reserve planner, roster and iCalendar output: a class of 60 on the seeds' node set."""
from __future__ import annotations

import datetime as dt
from collections import Counter
from pathlib import Path

import pytest

from labkit.errors import ReservationError
from labkit.course.reserve import check_leases, load_policy, make_plan, read_roster, report, write_ics
from labkit.course.reserve.ics import fold
from labkit.course.reserve.roster import Student, parse_student, roster_from_text

ROOT = Path(__file__).resolve().parent.parent
ROSTER = Path(__file__).resolve().parent / "data" / "reserve" / "roster60.csv"
FIRST, LAST = dt.date(2025, 2, 13), dt.date(2025, 2, 27)  # the term window in policy.yaml


@pytest.fixture(scope="module")
def policy():
    return load_policy(ROOT / "reservations" / "policy.yaml")


@pytest.fixture(scope="module")
def students(policy):
    return read_roster(ROSTER, policy.tz)


@pytest.fixture(scope="module")
def plan(students, policy):
    return make_plan(students, policy, FIRST, LAST)


def unescape(value: str) -> str:
    """Undo RFC 5545 TEXT escaping: \\n is a newline, \\x is x."""
    out, chars = [], iter(value)
    for c in chars:
        if c == "\\":
            c = next(chars)
            c = "\n" if c in "nN" else c
        out.append(c)
    return "".join(out)


def parse_ics(data: bytes) -> tuple[list[str], list[dict[str, str]]]:
    """A tiny RFC 5545 reader: checks the physical form, unfolds, returns (calendar lines, events)."""
    text = data.decode("utf-8")
    assert text.endswith("\r\n") and "\n" not in text.replace("\r\n", "")
    physical = text[:-2].split("\r\n")
    assert max(len(line.encode("utf-8")) for line in physical) <= 75
    logical: list[str] = []
    for line in physical:
        if line.startswith((" ", "\t")):
            logical[-1] += line[1:]
        else:
            logical.append(line)
    events, current = [], None
    for line in logical:
        name, _, value = line.partition(":")
        if line == "BEGIN:VEVENT":
            current = {}
        elif line == "END:VEVENT":
            events.append(current)
            current = None
        elif current is not None:
            current[name.split(";")[0]] = unescape(value)
    return logical, events


def utc(stamp: str) -> dt.datetime:
    assert stamp.endswith("Z"), stamp
    return dt.datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.timezone.utc)


# ---------------------------------------------------------------- the class of 60
def test_every_block_of_the_60_student_plan_passes_check(plan, policy):
    assert len(plan.assigned) + len(plan.unserved) == 60
    leases = plan.leases()
    assert len(leases) == sum(len(idx) for _, _, idx in plan.assigned)
    assert check_leases(leases, policy) == []
    patterns = Counter(name for _, name, _ in plan.assigned)
    assert patterns["one_block"] > 0 and patterns["two_blocks"] > 0  # the roster forces both routes


def test_plan_honours_unavailability_and_names_who_is_not_served(plan, students, policy):
    by_user = {s.user: s for s in students}
    for lease in plan.leases():
        assert by_user[lease.user].free(lease.start, lease.end, policy.tz), lease
    assert [u for u, _ in plan.unserved] == ["s51"]  # unavailable for the whole window
    text = report(plan)
    assert "s51: one_block: none of the course_a100x4 blocks in the window fits their availability" in text
    for day in range(15):
        assert f"{FIRST + dt.timedelta(days=day):%a %Y-%m-%d}" in text


def test_unconstrained_class_is_spread_evenly_over_the_days(policy):
    class_ = [Student(f"u{i:02d}") for i in range(60)]
    plan = make_plan(class_, policy, FIRST, LAST)
    loads = [given for _, given, _ in plan.day_load()]
    assert plan.unserved == () and max(loads) - min(loads) <= 1
    assert check_leases(plan.leases(), policy) == []


def test_capacity_shortfall_names_everyone_left_with_the_reason(policy):
    class_ = [Student(f"u{i:02d}") for i in range(60)]
    one_day = dt.date(2025, 2, 24)
    plan = make_plan(class_, policy, one_day, one_day)
    used = Counter(plan.slots[i].pool for _, _, idx in plan.assigned for i in idx)
    assert used["course_a100x4"] == 5  # 08:00, 11:00, 14:00, 17:00, 20:00
    assert len(plan.assigned) >= 25 and len(plan.assigned) + len(plan.unserved) == 60
    assert all("were given out first" in r or "overlap each other" in r for _, r in plan.unserved)
    assert check_leases(plan.leases(), policy) == []


def test_ics_is_rfc5545_and_parses_back_to_the_plan(plan, policy, tmp_path):
    stamp = dt.datetime(2025, 2, 1, 12, tzinfo=dt.timezone.utc)
    write_ics(plan, tmp_path / "s.ics", stamp=stamp)
    logical, events = parse_ics((tmp_path / "s.ics").read_bytes())
    assert logical[0] == "BEGIN:VCALENDAR" and logical[-1] == "END:VCALENDAR"
    assert "VERSION:2.0" in logical and any(line.startswith("PRODID:") for line in logical)
    assert all(e["DTSTAMP"] == "20250201T120000Z" for e in events)
    assert len({e["UID"] for e in events}) == len(events)
    back = sorted((e["X-LABKIT-USER"], e["X-LABKIT-NODE"], utc(e["DTSTART"]), utc(e["DTEND"])) for e in events)
    want = sorted((x.user, x.node, x.start, x.end) for x in plan.leases())
    assert back == want
    assert "labkit reserve create --node-type" in events[0]["DESCRIPTION"]


def test_fold_keeps_utf8_characters_whole():
    line = "SUMMARY:" + "Zoë Ångström — 3-h block; " * 8
    folded = fold(line)
    parts = folded.split("\r\n")
    assert len(parts) > 2
    for part in parts:
        assert len(part.encode("utf-8")) <= 75
    assert "".join([parts[0]] + [p[1:] for p in parts[1:]]) == line


# ---------------------------------------------------------------- the roster format
def test_roster_entries(policy):
    tz = policy.tz
    s = parse_student("ann", "2025-02-20; 2025-02-22/2025-02-23; 2025-02-25T18:00/2025-02-25T22:00; "
                             "Mon-Fri 09:00-17:00; Sun", tz)
    def free(start, end):
        return s.free(dt.datetime.fromisoformat(start).replace(tzinfo=tz),
                      dt.datetime.fromisoformat(end).replace(tzinfo=tz), tz)
    assert not free("2025-02-20T20:00", "2025-02-20T21:55")      # whole day
    assert not free("2025-02-23T20:00", "2025-02-23T21:55")      # end day included
    assert not free("2025-02-25T17:00", "2025-02-25T18:55")      # time range
    assert not free("2025-02-24T16:00", "2025-02-24T17:55")      # Mon-Fri 9-17
    assert free("2025-02-24T17:00", "2025-02-24T18:55")          # after 17:00 on a Monday
    assert not free("2025-03-02T08:00", "2025-03-02T10:55")      # Sunday
    assert free("2025-03-01T08:00", "2025-03-01T10:55")          # Saturday


def test_bad_roster_entry_names_row_and_entry(policy):
    with pytest.raises(ReservationError, match=r"row 3.*'Funday 9-5'"):
        roster_from_text("user,unavailable\nann,\nbob,Funday 9-5\n", policy.tz)
    with pytest.raises(ReservationError, match="appears twice"):
        roster_from_text("user,unavailable\nann,\nann,Sat\n", policy.tz)
