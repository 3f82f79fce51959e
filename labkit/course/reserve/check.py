"""Check leases against the course policy: one `Violation` per broken rule per lease.

Codes (stable; other tools match on them):
  malformed       the row cannot be read (missing field, no UTC offset, end before start)
  unknown_node    the node is not one of the course's nodes
  not_on_hour     the lease does not start at :00 (policy `leases.start_minute`)
  bad_end         the lease does not end at :55 (policy `leases.end_minute`)
  too_long        the lease lasts longer than its pool's block (3 h on the course node, 2 h else)
  outside_window  it starts before the node's available-from day or ends after the deadline
  overlap         two leases on one node overlap (both reported), or one user holds two at once
  daytime_quota   a user's daytime blocks go beyond one allowed pattern (one 3-h block, or one
                  2-h single-A100 block + one 2-h 4-GPU block); blocks wholly inside the
                  overnight window (1-7 AM) are extras and do not count
"""
from __future__ import annotations

import datetime as dt
import itertools
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from labkit.course.reserve.leases import Lease, Row
from labkit.course.reserve.policy import Policy

CODES = ("overlap", "too_long", "not_on_hour", "bad_end", "daytime_quota", "outside_window",
         "unknown_node", "malformed")


@dataclass(frozen=True)
class Violation:
    user: str
    node: str
    start: str
    end: str
    code: str
    message: str
    row: int = 0
    """Line in the source file (0 if none); orders the report, not part of `to_dict`."""

    def to_dict(self) -> dict[str, str]:
        data = asdict(self)
        del data["row"]
        return data

    def line(self) -> str:
        return f"{self.code}: {self.user} {self.node} {self.start} -> {self.end}: {self.message}"


def _violation(lease: Lease, code: str, message: str) -> Violation:
    return Violation(lease.user, lease.node, lease.start.isoformat(), lease.end.isoformat(), code,
                     f"row {lease.row}: {message}" if lease.row else message, lease.row)


def _clock(policy: Policy, when) -> str:
    return policy.local(when).strftime("%a %Y-%m-%d %H:%M %Z")


def _span(hours: float) -> str:
    minutes = round(hours * 60)
    return f"{minutes // 60}h{minutes % 60:02d}m"


def check_rows(rows: Sequence[Row], policy: Policy) -> list[Violation]:
    """Violations for rows read from a file: malformed rows are reported, the rest checked."""
    found = [Violation(r.user, r.node, r.start, r.end, "malformed", r.problem, r.row) for r in rows if r.problem]
    found += check_leases([r.lease for r in rows if r.lease is not None], policy)
    return sorted(found, key=lambda v: (v.row, CODES.index(v.code)))


def check_leases(leases: Iterable[Lease], policy: Policy) -> list[Violation]:
    """All violations of `leases` (already parsed, aware times), in a stable order."""
    leases = list(leases)
    known = [lease for lease in leases if policy.node(lease.node) is not None]
    found = [_violation(lease, "unknown_node",
                        f"{lease.node!r} is not a course node; book one of: "
                        f"{', '.join(n.name for n in policy.nodes)}")
             for lease in leases if policy.node(lease.node) is None]
    for lease in known:
        found += _shape(lease, policy)
    found += _overlaps(known, policy)
    found += _daytime_quota(known, policy)
    return sorted(found, key=lambda v: (v.row, dt.datetime.fromisoformat(v.start), v.node, v.user,
                                        CODES.index(v.code)))


def _shape(lease: Lease, policy: Policy) -> list[Violation]:
    """Rules about one lease on its own: on the hour, :55 end, block length, booking window."""
    found = []
    start, end = policy.local(lease.start), policy.local(lease.end)
    pool = policy.pool_of(lease.node)
    if (start.minute, start.second, start.microsecond) != (policy.start_minute, 0, 0):
        found.append(_violation(lease, "not_on_hour",
                                f"starts at {start:%H:%M:%S} {policy.timezone}; leases start on the hour "
                                f"(e.g. {start.replace(minute=policy.start_minute, second=0, microsecond=0):%H:%M})"))
    if (end.minute, end.second, end.microsecond) != (policy.end_minute, 0, 0):
        hour = start.replace(minute=policy.start_minute, second=0, microsecond=0)
        found.append(_violation(lease, "bad_end",
                                f"ends at {end:%H:%M:%S} {policy.timezone}; leases end at "
                                f":{policy.end_minute:02d}, just before an hour (a {pool.hours}-h block from "
                                f"{hour:%H:%M} ends {policy.local(policy.block_end(hour, pool.hours)):%H:%M})"))
    if lease.end - lease.start > dt.timedelta(hours=pool.hours):
        found.append(_violation(lease, "too_long",
                                f"lasts {_span(lease.hours)}; a block on {lease.node} ({pool.name}) is at most "
                                f"{pool.hours} h, e.g. 14:00 -> {14 + pool.hours - 1}:{policy.end_minute:02d}"))
    node = policy.node(lease.node)
    if lease.start < policy.opens(node):
        found.append(_violation(lease, "outside_window",
                                f"starts {_clock(policy, lease.start)}, before {lease.node} can be booked "
                                f"(from {node.available_from}); pick a later day"))
    if lease.end > policy.deadline:
        found.append(_violation(lease, "outside_window",
                                f"ends {_clock(policy, lease.end)}, after the deadline "
                                f"{_clock(policy, policy.deadline)}; finish the lab before it"))
    return found


def _overlaps(leases: list[Lease], policy: Policy) -> list[Violation]:
    """Same node overlapping (each side names the other user); one user holding two at once."""
    found = []
    ordered = sorted(leases, key=lambda lease: (lease.start, lease.end, lease.node, lease.user, lease.row))
    for i, a in enumerate(ordered):
        for b in itertools.takewhile(lambda b: b.start < a.end, itertools.islice(ordered, i + 1, None)):
            if not a.overlaps(b):
                continue
            if a.node == b.node:
                for x, y in ((a, b), (b, a)):
                    who = "another lease of the same user" if x.user == y.user else f"{y.user}'s lease"
                    found.append(_violation(x, "overlap", f"overlaps {who} on {y.node} "
                                            f"({_clock(policy, y.start)} -> {_clock(policy, y.end)}); "
                                            f"a node holds one lease at a time"))
            elif a.user == b.user:
                for x, y in ((a, b), (b, a)):
                    found.append(_violation(x, "overlap", f"{x.user} holds two overlapping leases: this one "
                                            f"and {y.node} ({_clock(policy, y.start)} -> {_clock(policy, y.end)}); "
                                            f"release one"))
    return found


def _daytime_quota(leases: list[Lease], policy: Policy) -> list[Violation]:
    """Per user: daytime blocks beyond the best-fitting allowed pattern (the latest are flagged)."""
    by_user: dict[str, list[Lease]] = defaultdict(list)
    for lease in leases:
        if not policy.is_overnight(lease.start, lease.end):
            by_user[lease.user].append(lease)
    found = []
    for user, day in by_user.items():
        day.sort(key=lambda lease: (lease.start, lease.node))
        name, kept = _best_pattern(day, policy)
        allowed = " or ".join(f"{n} ({' + '.join(p)})" for n, p in policy.patterns)
        for i, lease in enumerate(day):
            if i in kept:
                continue
            found.append(_violation(lease, "daytime_quota",
                                    f"{user} already has daytime blocks fitting {name} "
                                    f"({', '.join(f'{day[k].node} {_clock(policy, day[k].start)}' for k in kept)}); "
                                    f"the daytime allowance is {allowed}; staff delete extra daytime "
                                    f"leases - book extra time wholly inside "
                                    f"{policy.overnight_start:%H:%M}-{policy.overnight_end:%H:%M} instead"))
    return found


def _best_pattern(day: list[Lease], policy: Policy) -> tuple[str, list[int]]:
    """The pattern covering most of a user's daytime leases (indices into `day`), filled in time
    order so the latest extras are the ones flagged; ties go to the pattern listed first."""
    best_name, best = policy.patterns[0][0], []
    for name, pools in policy.patterns:
        left = list(pools)
        kept = []
        for i, lease in enumerate(day):
            pool = policy.node(lease.node).pool
            if pool in left:
                left.remove(pool)
                kept.append(i)
        if len(kept) > len(best):
            best_name, best = name, kept
    return best_name, best
