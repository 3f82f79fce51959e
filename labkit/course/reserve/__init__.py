"""Reservations on the course's shared GPU nodes (Chameleon): the policy, a checker, a planner.

The rules live in `reservations/policy.yaml`; `load_policy` reads them, `check_leases` /
`check_rows` report violations with stable codes, `make_plan` gives a class legal blocks and
`report` / `write_ics` publish the plan. `labkit.course.reserve.chi` talks to Chameleon (python-chi,
imported lazily). CLI: `labkit reserve check|plan|create`. Introduced in `reservations/README.md`.
"""
from labkit.course.reserve.check import CODES, Violation, check_leases, check_rows
from labkit.course.reserve.leases import Lease, Row, parse_time, read_rows, write_leases
from labkit.course.reserve.allocate import Plan, make_plan, make_slots, report, write_ics
from labkit.course.reserve.policy import Policy, default_policy_path, load_policy
from labkit.course.reserve.request import check_request, lease_request, pick_node
from labkit.course.reserve.roster import Student, read_roster

__all__ = ["CODES", "Lease", "Plan", "Policy", "Row", "Student", "Violation", "check_leases",
           "check_request", "check_rows", "default_policy_path", "lease_request", "load_policy",
           "make_plan", "make_slots", "parse_time", "pick_node", "read_roster", "read_rows", "report",
           "write_ics", "write_leases"]
