"""One block request, before it goes to Chameleon: pick the node, check it, build the lease body.

Pure (no python-chi): `labkit reserve create --dry-run` and `reservations/reserve.ipynb` print and
check the request here; `labkit.course.reserve.chi.submit_lease` sends it.
"""
from __future__ import annotations

import datetime as dt
import json

from labkit.errors import ReservationError
from labkit.course.reserve.check import Violation, check_leases
from labkit.course.reserve.leases import Lease
from labkit.course.reserve.policy import Node, Policy

#: python-chi's lease time format (a UTC wall clock), as its `chi.lease.BLAZAR_TIME_FORMAT`.
BLAZAR_TIME_FORMAT = "%Y-%m-%d %H:%M"


def check_request(policy: Policy, node: str, start: dt.datetime, hours: int, *, user: str = "you") -> list[Violation]:
    """Violations of one requested block on its own (quota and overlaps need the other leases)."""
    return check_leases([Lease(user, node, start, policy.block_end(start, hours))], policy)


def pick_node(policy: Policy, node_type: str, start: dt.datetime, hours: int, node: str | None = None) -> Node:
    """`node` if given (it must be of `node_type`), else the first node of the type that passes the
    policy for this block, preferring nodes whose block length is exactly `hours`."""
    candidates = policy.nodes_of_type(node_type)
    if not candidates:
        raise ReservationError(f"no course node has type {node_type!r}; types are: {', '.join(policy.node_types)}")
    if node is not None:
        chosen = [n for n in candidates if n.name == node]
        if not chosen:
            raise ReservationError(f"{node!r} is not a {node_type} course node; those are: "
                                   f"{', '.join(n.name for n in candidates)}")
        return chosen[0]
    candidates.sort(key=lambda n: policy.pool(n.pool).hours != hours)
    return next((n for n in candidates if not check_request(policy, n.name, start, hours)), candidates[0])


def _utc(when: dt.datetime) -> str:
    return when.astimezone(dt.timezone.utc).strftime(BLAZAR_TIME_FORMAT)


def lease_request(policy: Policy, node: Node, start: dt.datetime, hours: int, *, name: str) -> dict:
    """The lease python-chi is asked for: one node by name, start/end in Blazar's UTC format
    (python-chi formats naive datetimes and Blazar reads them as UTC)."""
    end = policy.block_end(start, hours)
    return {
        "name": name, "site": node.site, "node_type": node.node_type, "node": node.name,
        "start": policy.local(start).isoformat(), "end": policy.local(end).isoformat(),
        "start_date": _utc(start), "end_date": _utc(end),
        "reservations": [{"resource_type": "physical:host",
                          "resource_properties": json.dumps(["==", "$node_name", node.name]),
                          "hypervisor_properties": "", "min": 1, "max": 1}],
    }
