"""The python-chi adapter: the only module that talks to Chameleon.

python-chi is imported lazily (it is preinstalled on Chameleon's Jupyter, not in the course venv),
so everything else in `labkit.course.reserve` works without it; the request it sends is built (and
checked) by the pure `labkit.course.reserve.request`. Used by `reservations/reserve.ipynb`.
"""
from __future__ import annotations

import datetime as dt

# python-chi itself is reached through labkit.lease (core: training asks it for the lease's end)
from labkit.lease import _aware_utc, require_chi
from labkit.lease import chi_lease_end as lease_end  # noqa: F401  (public here too)
from labkit.course.reserve.leases import Lease, Row
from labkit.course.reserve.policy import Policy
from labkit.course.reserve.request import BLAZAR_TIME_FORMAT

DEFAULT_IMAGE = "CC-Ubuntu24.04-CUDA"


def connect(project: str, site: str):
    """Select the Chameleon project (e.g. 'CHI-251409') and site (e.g. 'CHI@UC')."""
    chi = require_chi()
    chi.set("project_name", project)
    chi.use_site(site)
    return chi


def submit_lease(request: dict, *, wait: bool = False, timeout_s: int = 600):
    """Create the lease from `request.lease_request` output (idempotent by name); with `wait`, block
    until it is ACTIVE - which happens only at its start time, so wait only once the block has begun."""
    chi = require_chi()
    start = dt.datetime.strptime(request["start_date"], BLAZAR_TIME_FORMAT)
    end = dt.datetime.strptime(request["end_date"], BLAZAR_TIME_FORMAT)
    lease = chi.lease.Lease(request["name"], start_date=start, end_date=end)
    lease.add_node_reservation(node_name=request["node"])
    lease.submit(wait_for_active=wait, wait_timeout=timeout_s, idempotent=True)
    return lease


def get_lease(ref: str):
    return require_chi().lease.get_lease(ref)


def wait_active(ref: str, *, timeout_s: int = 600):
    """The lease, once ACTIVE (call at the start of the block)."""
    lease = get_lease(ref)
    lease.wait(status="active", timeout=timeout_s)
    return lease


def live_leases(policy: Policy) -> list[Row]:
    """Every allocation on the policy's nodes, read from Blazar, as rows for `check_rows`.
    Users are Chameleon user ids where the lease is visible to this project, else `lease:<id>`."""
    chi = require_chi()
    blazar = chi.clients.blazar()
    owners = {item["id"]: item.get("user_id", "") for item in blazar.lease.list()}
    rows = []
    for host in blazar.host.list():
        name = host.get("node_name") or host.get("hypervisor_hostname")
        if policy.node(name) is None:
            continue
        for res in (blazar.host.get_allocation(host["id"]) or {}).get("reservations", []):
            start, end = _aware_utc(res["start_date"]), _aware_utc(res["end_date"])
            user = owners.get(res.get("lease_id")) or f"lease:{res.get('lease_id', '?')}"
            rows.append(Row(user, name, start.isoformat(), end.isoformat(), 0, Lease(user, name, start, end)))
    return rows


def launch_server(lease, name: str, *, image: str = DEFAULT_IMAGE):
    """Bare-metal server on the lease's node with a CUDA image, a floating IP, reachable by SSH."""
    chi = require_chi()
    server = chi.server.Server(name, reservation_id=lease.node_reservations[0]["id"], image_name=image)
    server.submit(idempotent=True)  # waits until ACTIVE (bare metal: ~10 min)
    server.associate_floating_ip()
    server.refresh()
    server.check_connectivity()
    server.show(type="text")
    return server


#: How the course environment comes up on a fresh CUDA image (the README's "On a course GPU node").
SETUP_COMMANDS = (
    "test -x ~/miniforge3/bin/conda || (curl -sSL -o /tmp/miniforge.sh https://github.com/conda-forge/"
    "miniforge/releases/latest/download/Miniforge3-Linux-x86_64.sh && bash /tmp/miniforge.sh -b -p ~/miniforge3)",
    "cd labkit && (~/miniforge3/bin/conda env list | grep -q '^labkit ' "
    "|| ~/miniforge3/bin/conda env create -f environment.yml)",
    "cd labkit && ~/miniforge3/bin/conda run -n labkit pip install -e . "
    "&& ~/miniforge3/bin/conda run -n labkit python -m ipykernel install --user --name labkit",
)


def bring_up(server, *, repo: str, end: dt.datetime, commands=SETUP_COMMANDS) -> None:
    """Clone the course, build its environment, and record the lease end for `labkit.lease`."""
    stamp = end.astimezone(dt.timezone.utc).isoformat()
    server.execute(f"test -d labkit || git clone {repo} labkit")
    for command in commands:
        server.execute(command)
    server.execute(f"sed -i '/LABKIT_LEASE_END/d' ~/.profile; echo 'export LABKIT_LEASE_END={stamp}' >> ~/.profile")


def release(server=None, lease=None) -> None:
    """Delete the server and the lease (free the node early for the next student)."""
    if server is not None:
        server.delete()
    if lease is not None:
        lease.delete()
