"""Plan a term: give every student a legal block (or two), spread evenly over the days.

How (greedy, deterministic):
1. Cut each node's bookable days into legal blocks (`planner.day_start`..`day_end`, on the hour,
   ending at :55), inside the term, the node's available-from day and the deadline.
2. Serve the least flexible students first (fewest blocks that fit their availability), so the
   many-options students do not take the only block a constrained one could use.
3. For each student try the daytime patterns in policy order (the one 3-h block first), filling each
   pool with the free, fitting block on the least-loaded day, then the least-used hour of day, then
   the earliest - which spreads the class evenly over the window instead of piling onto the deadline.
4. Anyone left is named, with the reason per pattern (nothing fits their availability, or every
   fitting block was given out first).
Every block passes `check_leases` by construction; the tests re-check it.
"""
from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass

from labkit.errors import ReservationError
from labkit.course.reserve.ics import Event, calendar
from labkit.course.reserve.leases import Lease
from labkit.course.reserve.policy import Policy
from labkit.course.reserve.roster import Student


@dataclass(frozen=True)
class Slot:
    """One legal block on one node."""

    node: str
    pool: str
    start: dt.datetime
    end: dt.datetime
    day: dt.date
    """Local (course time) day of the start: the unit of the per-day load."""


@dataclass(frozen=True)
class Plan:
    policy: Policy
    first: dt.date
    last: dt.date
    slots: tuple[Slot, ...]
    assigned: tuple[tuple[str, str, tuple[int, ...]], ...]
    """(user, pattern name, slot indices) per served student, in roster order."""
    unserved: tuple[tuple[str, str], ...]
    """(user, reason) per student who could not be given a legal block."""

    def leases(self) -> list[Lease]:
        out = [Lease(user, self.slots[i].node, self.slots[i].start, self.slots[i].end)
               for user, _, idx in self.assigned for i in idx]
        return sorted(out, key=lambda lease: (lease.start, lease.node))

    def day_load(self) -> list[tuple[dt.date, int, int]]:
        """(day, blocks given, blocks that exist) for every day of the window."""
        given = Counter(self.slots[i].day for _, _, idx in self.assigned for i in idx)
        exist = Counter(s.day for s in self.slots)
        days = [self.first + dt.timedelta(days=k) for k in range((self.last - self.first).days + 1)]
        return [(d, given[d], exist[d]) for d in days]


def make_slots(policy: Policy, first: dt.date, last: dt.date) -> list[Slot]:
    """Every legal block in [first, last] (course days), sorted by start then node."""
    slots = []
    for node in policy.nodes:
        pool = policy.pool(node.pool)
        day = max(first, node.available_from)
        while day <= last:
            start = policy.at(day, policy.plan_day_start)
            while start + dt.timedelta(hours=pool.hours) <= policy.at(day, policy.plan_day_end):
                end = policy.block_end(start, pool.hours)
                if end <= policy.deadline and not policy.is_overnight(start, end):
                    slots.append(Slot(node.name, pool.name, start, end, day))
                start += dt.timedelta(hours=pool.hours)
            day += dt.timedelta(days=1)
    return sorted(slots, key=lambda s: (s.start, s.node))


class _Planner:
    """Mutable bookkeeping for one `make_plan` call."""

    def __init__(self, policy: Policy, slots: list[Slot]):
        self.policy, self.slots = policy, slots
        self.taken: set[int] = set()
        self.day_load: Counter = Counter()
        self.hour_load: Counter = Counter()

    def fitting(self, student: Student) -> dict[str, list[int]]:
        tz = self.policy.tz
        fit: dict[str, list[int]] = {p.name: [] for p in self.policy.pools}
        for i, slot in enumerate(self.slots):
            if student.free(slot.start, slot.end, tz):
                fit[slot.pool].append(i)
        return fit

    def _key(self, i: int, chosen: list[int]):
        slot = self.slots[i]
        same_day = sum(self.slots[j].day == slot.day for j in chosen)
        return (self.day_load[slot.day] + same_day, self.hour_load[self.policy.local(slot.start).hour],
                slot.start, slot.node)

    def fill(self, pools: tuple[str, ...], fit: dict[str, list[int]], chosen: list[int]) -> list[int] | None:
        """Free fitting slots, one per pool, pairwise non-overlapping; best-first backtracking."""
        if len(chosen) == len(pools):
            return chosen
        pool = pools[len(chosen)]
        free = [i for i in fit[pool] if i not in self.taken and not any(
            self.slots[i].start < self.slots[j].end and self.slots[j].start < self.slots[i].end for j in chosen)]
        for i in sorted(free, key=lambda i: self._key(i, chosen)):
            done = self.fill(pools, fit, chosen + [i])
            if done is not None:
                return done
        return None

    def commit(self, chosen: list[int]) -> None:
        for i in chosen:
            self.taken.add(i)
            self.day_load[self.slots[i].day] += 1
            self.hour_load[self.policy.local(self.slots[i].start).hour] += 1

    def reason(self, pools: tuple[str, ...], fit: dict[str, list[int]]) -> str:
        for pool in pools:
            if not fit[pool]:
                return f"none of the {pool} blocks in the window fits their availability"
            if all(i in self.taken for i in fit[pool]):
                return (f"all {len(fit[pool])} {pool} blocks that fit their availability were given "
                        f"out first (to students with fewer options, or earlier in the roster)")
        return "the free blocks that fit their availability overlap each other"


def make_plan(students: list[Student], policy: Policy, first: dt.date, last: dt.date) -> Plan:
    """Assign blocks to `students` between the course days `first` and `last` (inclusive)."""
    if last < first:
        raise ReservationError(f"--to {last} is before --from {first}; swap them")
    slots = make_slots(policy, first, last)
    planner = _Planner(policy, slots)
    fits = {s.user: planner.fitting(s) for s in students}

    def flexibility(item):
        index, student = item
        fit = fits[student.user]
        return (sum(min(len(fit[p]) for p in pools) for _, pools in policy.patterns), index)

    assigned, unserved = {}, {}
    for _, student in sorted(enumerate(students), key=flexibility):
        fit = fits[student.user]
        for name, pools in policy.patterns:
            chosen = planner.fill(pools, fit, [])
            if chosen is not None:
                planner.commit(chosen)
                assigned[student.user] = (name, tuple(chosen))
                break
        else:
            unserved[student.user] = "; ".join(f"{name}: {planner.reason(pools, fit)}"
                                               for name, pools in policy.patterns)
    order = [s.user for s in students]
    return Plan(policy, first, last, tuple(slots),
                tuple((u, *assigned[u]) for u in order if u in assigned),
                tuple((u, unserved[u]) for u in order if u in unserved))


def report(plan: Plan) -> str:
    """The capacity report: who got what, per-pool use, per-day load, and who was not served."""
    policy = plan.policy
    patterns = Counter(name for _, name, _ in plan.assigned)
    lines = [f"plan {plan.first} .. {plan.last} ({policy.timezone}): {len(plan.assigned) + len(plan.unserved)} "
             f"students, {len(plan.assigned)} served, {len(plan.unserved)} not served",
             "patterns: " + ", ".join(f"{name} {patterns[name]}" for name, _ in policy.patterns),
             "capacity (blocks given / legal blocks in the window):"]
    used = Counter(plan.slots[i].pool for _, _, idx in plan.assigned for i in idx)
    exist = Counter(s.pool for s in plan.slots)
    for pool in policy.pools:
        names = ", ".join(n.name for n in policy.nodes if n.pool == pool.name)
        lines.append(f"  {pool.name:<14} {used[pool.name]:>4} / {exist[pool.name]:<4} {pool.hours}-h blocks on {names}")
    lines.append("per-day load (blocks given / legal blocks that day):")
    for day, given, total in plan.day_load():
        lines.append(f"  {day:%a %Y-%m-%d} {given:>4} / {total:<4} {'#' * given}")
    if plan.unserved:
        lines.append("not served:")
        lines += [f"  {user}: {reason}" for user, reason in plan.unserved]
    return "\n".join(lines)


def events(plan: Plan) -> list[Event]:
    """One calendar event per block, carrying the lease command that books it."""
    policy, out = plan.policy, []
    for user, pattern, idx in plan.assigned:
        for i in idx:
            slot, node = plan.slots[i], policy.node(plan.slots[i].node)
            start = policy.local(slot.start).isoformat()
            hours = policy.pool(slot.pool).hours
            out.append(Event(
                uid=f"{slot.start:%Y%m%dT%H%M}-{slot.node}-{user}@labkit-reserve",
                start=slot.start, end=slot.end,
                summary=f"{user}: {hours}-h lab block on {slot.node} ({node.gpus})",
                description=(f"Daytime pattern {pattern}. Book it with: labkit reserve create --node-type "
                             f"{node.node_type} --node {slot.node} --start {start} --hours {hours}. Save "
                             f"your work before {policy.local(slot.end):%H:%M}: the lease ends then."),
                location=f"{node.site} {slot.node}", categories=("labkit", slot.pool),
                extra=(("X-LABKIT-USER", user), ("X-LABKIT-NODE", slot.node))))
    return sorted(out, key=lambda e: (e.start, e.uid))


def write_ics(plan: Plan, path, *, stamp: dt.datetime | None = None) -> str:
    text = calendar(events(plan), name=f"labkit lab blocks {plan.first}..{plan.last}", stamp=stamp)
    with open(path, "w", encoding="utf-8", newline="") as f:  # keep the CRLFs as written
        f.write(text)
    return text
