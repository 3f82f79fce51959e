"""`labkit reserve check|plan|create`: the course's lease rules from the command line.

Thin printers over the pure cores in `labkit.course.reserve` (tests call those in-process). Exit codes:
`check` 0 when the file was read (violations or not), 2 when it cannot be read at all;
`create` 1 when the request breaks the policy (nothing is submitted).
"""
from __future__ import annotations

import datetime as dt
import json
import sys

import click

from labkit.errors import ReservationError
from labkit.course.reserve import chi as chi_adapter
from labkit.course.reserve.check import check_rows
from labkit.course.reserve.leases import parse_time, read_rows, write_leases
from labkit.course.reserve.allocate import make_plan, report, write_ics
from labkit.course.reserve.policy import Policy, default_policy_path, load_policy
from labkit.course.reserve.request import check_request, lease_request, pick_node
from labkit.course.reserve.roster import read_roster

_POLICY = click.option("--policy", "policy_path", type=click.Path(dir_okay=False), default=None,
                       help="Policy YAML [default: reservations/policy.yaml].")


def _load(policy_path) -> Policy:
    return load_policy(policy_path or default_policy_path())


def _fail(message: str, code: int = 2):
    click.echo(f"error: {message}", err=True)
    raise click.exceptions.Exit(code)


@click.group()
def command():
    """Reserve GPU nodes by the course's rules (reservations/policy.yaml)."""


@command.command()
@click.argument("leases", required=False, type=click.Path(dir_okay=False))
@_POLICY
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of {user,node,start,end,code,message}.")
@click.option("--live", is_flag=True, help="Read the live leases on the policy's nodes through python-chi.")
@click.option("--project", default=None, help="Chameleon project for --live, e.g. CHI-251409.")
@click.option("--site", default="CHI@UC", show_default=True, help="Chameleon site for --live.")
def check(leases, policy_path, as_json, live, project, site):
    """Check LEASES.csv (columns user,node,start,end; ISO 8601 times with UTC offset): one violation
    per line. Exit 0 when the file was read, 2 when it cannot be read."""
    try:
        policy = _load(policy_path)
        if live and leases:
            _fail("give LEASES.csv or --live, not both")
        if live:
            if project:
                chi_adapter.connect(project, site)
            rows = chi_adapter.live_leases(policy)
        elif leases is None:
            _fail("give LEASES.csv (columns user,node,start,end), or --live to read Chameleon")
        else:
            rows = read_rows(leases, tz_hint=policy.tz)
    except ReservationError as exc:
        _fail(str(exc))
    found = check_rows(rows, policy)
    if as_json:
        click.echo(json.dumps([v.to_dict() for v in found], indent=2))
    else:
        for violation in found:
            click.echo(violation.line())
    click.echo(f"{len(rows)} row(s) checked against {policy.source}: {len(found)} violation(s)", err=True)


def _day(text: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a date; write YYYY-MM-DD (course time)") from None


@command.command()
@click.option("--roster", required=True, type=click.Path(dir_okay=False),
              help="CSV: user,unavailable (see reservations/README.md).")
@_POLICY
@click.option("--from", "first", required=True, help="First day, YYYY-MM-DD (course time).")
@click.option("--to", "last", required=True, help="Last day, YYYY-MM-DD (course time).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Write the schedule as iCalendar (.ics).")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Also write it as user,node,start,end (checkable with `labkit reserve check`).")
def plan(roster, policy_path, first, last, out, csv_path):
    """Give every student on ROSTER a legal block (or two) between --from and --to, spread evenly
    over the days; print a capacity report naming who cannot be served and why."""
    try:
        policy = _load(policy_path)
        students = read_roster(roster, policy.tz)
        result = make_plan(students, policy, _day(first), _day(last))
    except ReservationError as exc:
        _fail(str(exc))
    write_ics(result, out)
    if csv_path:
        write_leases(result.leases(), csv_path, tz=policy.tz)
    click.echo(report(result))
    click.echo(f"wrote {out}" + (f" and {csv_path}" if csv_path else ""), err=True)


@command.command()
@click.option("--node-type", required=True, help="Chameleon node type: gpu_a100_pcie, compute_gigaio, gpu_v100.")
@click.option("--start", "start_text", required=True,
              help="Start, ISO 8601 with UTC offset, e.g. 2025-02-21T14:00:00-05:00.")
@click.option("--hours", required=True, type=click.IntRange(min=1), help="Block length in hours (ends at :55).")
@click.option("--node", "node_name", default=None, help="A specific course node, e.g. 307G3Q3.")
@click.option("--name", default=None, help="Lease name [default: labkit-$USER-<node>-<start>].")
@_POLICY
@click.option("--dry-run", is_flag=True, help="Print the request and the policy check; submit nothing.")
@click.option("--project", default=None, help="Chameleon project, e.g. CHI-251409 (else python-chi's default).")
def create(node_type, start_text, hours, node_name, name, policy_path, dry_run, project):
    """Create the python-chi lease for one block, after checking it against the policy."""
    try:
        policy = _load(policy_path)
        start = parse_time(start_text, tz_hint=policy.tz, field="--start")
        node = pick_node(policy, node_type, start, hours, node_name)
    except ReservationError as exc:
        _fail(str(exc))
    name = name or f"labkit-{_user()}-{node.name}-{policy.local(start):%Y%m%dT%H%M}"
    request = lease_request(policy, node, start, hours, name=name)
    click.echo(json.dumps(request, indent=2))
    found = check_request(policy, node.name, start, hours)
    for violation in found:
        click.echo(violation.line())
    if found:
        _fail(f"the request breaks the policy ({len(found)} violation(s)); nothing was submitted", 1)
    click.echo(f"policy check: OK ({policy.source})", err=True)
    if dry_run:
        return
    try:
        if project:
            chi_adapter.connect(project, node.site)
        lease = chi_adapter.submit_lease(request, wait=False)
    except ReservationError as exc:
        _fail(str(exc))
    click.echo(f"created lease {name} ({getattr(lease, 'id', '?')}); it becomes ACTIVE at {request['start']}")


def _user() -> str:
    import getpass
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name (some containers); the lease name is cosmetic
        return "student"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(command())
