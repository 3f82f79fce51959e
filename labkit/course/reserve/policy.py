"""The course's reservation rules, read from `reservations/policy.yaml` (the only place they live).

Times are interpreted in the policy's time zone with `zoneinfo`, so the 1-7 AM window and "start on
the hour" stay right across daylight-saving changes; durations are measured in absolute time.
Introduced in `reservations/README.md`.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml

from labkit.errors import ReservationError

#: Where the course keeps its policy, relative to the repository root.
DEFAULT_POLICY = Path("reservations") / "policy.yaml"

_TOP_KEYS = {"version", "timezone", "term", "leases", "overnight", "pools", "nodes",
             "daytime_patterns", "planner"}
_NODE_KEYS = {"type", "pool", "site", "gpus", "available_from"}


@dataclass(frozen=True)
class Pool:
    """Interchangeable nodes sharing one block length."""

    name: str
    hours: int
    """Block length: a lease on this pool lasts at most `hours` (e.g. 14:00 -> 16:55 for 3)."""
    description: str = ""


@dataclass(frozen=True)
class Node:
    """One bookable testbed node, by its Chameleon name."""

    name: str
    node_type: str
    """Chameleon `node_type`, e.g. gpu_a100_pcie, compute_gigaio, gpu_v100."""
    pool: str
    site: str
    gpus: str
    available_from: dt.date
    """First local day a lease may start on this node."""


@dataclass(frozen=True)
class Policy:
    """The rules as one validated object; build it with `load_policy`."""

    timezone: str
    term_start: dt.date
    deadline: dt.datetime
    """Aware; no lease may end after it."""
    start_minute: int
    end_minute: int
    overnight_start: dt.time
    overnight_end: dt.time
    pools: tuple[Pool, ...]
    nodes: tuple[Node, ...]
    patterns: tuple[tuple[str, tuple[str, ...]], ...]
    """(name, pools): a user's daytime blocks must fit one pattern, one block per listed pool."""
    plan_day_start: dt.time
    plan_day_end: dt.time
    source: str = ""

    @property
    def tz(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def node(self, name: str) -> Node | None:
        return next((n for n in self.nodes if n.name == name), None)

    def pool(self, name: str) -> Pool:
        return next(p for p in self.pools if p.name == name)

    def pool_of(self, node_name: str) -> Pool:
        return self.pool(self.node(node_name).pool)

    def nodes_of_type(self, node_type: str) -> list[Node]:
        return [n for n in self.nodes if n.node_type == node_type]

    @property
    def node_types(self) -> list[str]:
        return sorted({n.node_type for n in self.nodes})

    def local(self, when: dt.datetime) -> dt.datetime:
        return when.astimezone(self.tz)

    def at(self, day: dt.date, time: dt.time) -> dt.datetime:
        """Aware datetime for a wall-clock time on a local day."""
        return dt.datetime.combine(day, time, tzinfo=self.tz)

    def opens(self, node: Node) -> dt.datetime:
        return self.at(node.available_from, dt.time(0))

    def block_end(self, start: dt.datetime, hours: int) -> dt.datetime:
        """End of a block of `hours` from `start`, at the end minute (14:00 + 3 h -> 16:55)."""
        return start + dt.timedelta(hours=hours, minutes=self.end_minute - 60)

    def is_overnight(self, start: dt.datetime, end: dt.datetime) -> bool:
        """True when [start, end] lies wholly inside the overnight window of its local day."""
        day = self.local(start).date()
        return self.at(day, self.overnight_start) <= start and end <= self.at(day, self.overnight_end)


def default_policy_path() -> Path:
    """`reservations/policy.yaml` from the repository root, `policy.yaml` from inside `reservations/`
    (where reserve.ipynb runs), else the one in the checkout labkit is installed from."""
    for candidate in (DEFAULT_POLICY, Path("policy.yaml")):
        if candidate.exists() and Path.cwd().joinpath(candidate).parent.name == "reservations":
            return candidate
    return Path(__file__).resolve().parents[3] / DEFAULT_POLICY


def load_policy(path: str | Path | None = None) -> Policy:
    """Read and validate a policy file; every problem is a `ReservationError` naming the key."""
    path = Path(path) if path is not None else default_policy_path()
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ReservationError(f"cannot read policy {path}: {exc.strerror}; pass --policy "
                               f"reservations/policy.yaml from the labkit checkout") from exc
    except yaml.YAMLError as exc:
        raise ReservationError(f"policy {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ReservationError(f"policy {path} must be a YAML mapping with keys {sorted(_TOP_KEYS)}")
    return policy_from_dict(data, source=str(path))


def policy_from_dict(data: dict, *, source: str = "<dict>") -> Policy:
    """Validate the parsed YAML (see `reservations/policy.yaml` for the schema)."""
    _no_unknown(data, _TOP_KEYS, "policy")
    timezone = _get(data, "timezone", str, "policy")
    try:
        tz = ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ReservationError(f"policy timezone {timezone!r} is unknown; use an IANA name such as "
                               f"'America/New_York'") from exc
    term = _get(data, "term", dict, "policy")
    _no_unknown(term, {"start", "deadline"}, "term")
    term_start = _date(_get(term, "start", (str, dt.date), "term"), "term.start")
    deadline = _local_datetime(_get(term, "deadline", (str, dt.datetime), "term"), tz, "term.deadline")
    leases = _get(data, "leases", dict, "policy")
    _no_unknown(leases, {"start_minute", "end_minute"}, "leases")
    start_minute, end_minute = (_minute(leases, k) for k in ("start_minute", "end_minute"))
    night = _get(data, "overnight", dict, "policy")
    _no_unknown(night, {"start", "end"}, "overnight")
    planner = _get(data, "planner", dict, "policy")
    _no_unknown(planner, {"day_start", "day_end"}, "planner")
    pools = _pools(_get(data, "pools", dict, "policy"))
    nodes = _nodes(_get(data, "nodes", dict, "policy"), pools, term_start)
    patterns = _patterns(_get(data, "daytime_patterns", dict, "policy"), pools)
    policy = Policy(
        timezone=timezone, term_start=term_start, deadline=deadline,
        start_minute=start_minute, end_minute=end_minute,
        overnight_start=_time(night, "start", "overnight"), overnight_end=_time(night, "end", "overnight"),
        pools=pools, nodes=nodes, patterns=patterns,
        plan_day_start=_time(planner, "day_start", "planner"), plan_day_end=_time(planner, "day_end", "planner"),
        source=source)
    _check_order(policy)
    return policy


def _check_order(policy: Policy) -> None:
    if not policy.overnight_start < policy.overnight_end:
        raise ReservationError("overnight.start must be before overnight.end (e.g. '01:00' and '07:00')")
    if not policy.plan_day_start < policy.plan_day_end:
        raise ReservationError("planner.day_start must be before planner.day_end (e.g. '08:00', '23:00')")
    if policy.deadline.date() < policy.term_start:
        raise ReservationError(f"term.deadline {policy.deadline.isoformat()} is before term.start "
                               f"{policy.term_start}; fix the term dates")


def _pools(raw: dict) -> tuple[Pool, ...]:
    pools = []
    for name, spec in raw.items():
        if not isinstance(spec, dict):
            raise ReservationError(f"pools.{name} must be a mapping with 'hours' (and 'description')")
        _no_unknown(spec, {"hours", "description"}, f"pools.{name}")
        hours = _get(spec, "hours", int, f"pools.{name}")
        if hours < 1:
            raise ReservationError(f"pools.{name}.hours={hours}; a block lasts at least 1 hour")
        pools.append(Pool(str(name), hours, str(spec.get("description", ""))))
    if not pools:
        raise ReservationError("policy has no pools; define at least one under 'pools'")
    return tuple(pools)


def _nodes(raw: dict, pools: tuple[Pool, ...], term_start: dt.date) -> tuple[Node, ...]:
    names = {p.name for p in pools}
    nodes = []
    for name, spec in raw.items():
        where = f"nodes.{name}"
        if not isinstance(spec, dict):
            raise ReservationError(f"{where} must be a mapping with keys {sorted(_NODE_KEYS)}")
        _no_unknown(spec, _NODE_KEYS, where)
        pool = _get(spec, "pool", str, where)
        if pool not in names:
            raise ReservationError(f"{where}.pool={pool!r} is not a pool; pools are: {', '.join(sorted(names))}")
        start = _date(spec.get("available_from", term_start), f"{where}.available_from")
        nodes.append(Node(str(name), _get(spec, "type", str, where), pool, _get(spec, "site", str, where),
                          str(spec.get("gpus", "")), max(start, term_start)))
    if not nodes:
        raise ReservationError("policy has no nodes; list the course's nodes under 'nodes'")
    return tuple(nodes)


def _patterns(raw: dict, pools: tuple[Pool, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    names = {p.name for p in pools}
    patterns = []
    for name, members in raw.items():
        if not isinstance(members, list) or not members or not all(m in names for m in members):
            raise ReservationError(f"daytime_patterns.{name}={members!r} must be a non-empty list of "
                                   f"pools ({', '.join(sorted(names))})")
        patterns.append((str(name), tuple(members)))
    if not patterns:
        raise ReservationError("policy has no daytime_patterns; e.g. one_block: [course_a100x4]")
    unused = sorted(names - {m for _, members in patterns for m in members})
    if unused:
        raise ReservationError(f"pool(s) {unused} appear in no daytime_patterns entry, so no daytime "
                               f"block on them could ever be legal; add them to a pattern")
    return tuple(patterns)


def _no_unknown(mapping: dict, known: set[str], where: str) -> None:
    unknown = sorted(str(k) for k in set(mapping) - known)
    if unknown:
        raise ReservationError(f"unknown key(s) {unknown} in {where}; valid keys are {sorted(known)}")


def _get(mapping: dict, key: str, kind, where: str):
    if key not in mapping:
        raise ReservationError(f"{where} is missing {key!r}")
    value = mapping[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ReservationError(f"{where}.{key}={value!r} must be a {names}")
    return value


def _minute(mapping: dict, key: str) -> int:
    value = _get(mapping, key, int, "leases")
    if not 0 <= value <= 59:
        raise ReservationError(f"leases.{key}={value}; a minute is 0..59")
    return value


def _date(value, where: str) -> dt.date:
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        return value
    try:
        return dt.date.fromisoformat(str(value))
    except ValueError as exc:
        raise ReservationError(f"{where}={value!r} is not a date; write it as \"YYYY-MM-DD\"") from exc


def _local_datetime(value, tz: ZoneInfo, where: str) -> dt.datetime:
    try:
        when = value if isinstance(value, dt.datetime) else dt.datetime.fromisoformat(str(value))
    except ValueError as exc:
        raise ReservationError(f"{where}={value!r} is not a date-time; write \"YYYY-MM-DDTHH:MM\"") from exc
    return when.replace(tzinfo=tz) if when.tzinfo is None else when


def _time(mapping: dict, key: str, where: str) -> dt.time:
    value = mapping.get(key)
    if not isinstance(value, str):
        raise ReservationError(f"{where}.{key}={value!r} must be a quoted \"HH:MM\" string "
                               f"(YAML reads an unquoted 01:00 as the number 60)")
    try:
        return dt.time.fromisoformat(value)
    except ValueError as exc:
        raise ReservationError(f"{where}.{key}={value!r} is not a time; write \"HH:MM\"") from exc
