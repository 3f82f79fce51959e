"""`labkit env [--json]`: versions, devices, the NVIDIA driver, whether this environment is the class's
lock (requirements/lock.txt), and which profiles this machine can run (core: labkit.runtime.envinfo)."""
from __future__ import annotations

import json

import click


@click.command("env")
@click.option("--json", "as_json", is_flag=True, help="Print the facts as JSON (nothing else on stdout).")
def command(as_json: bool) -> None:
    """Show Python/torch/CUDA/NCCL/library versions, devices and the NVIDIA driver, whether this
    environment matches the class's lock (requirements/lock.txt) and what differs, and the profiles
    this machine can run."""
    from labkit.runtime import envinfo

    facts = envinfo.collect()
    click.echo(json.dumps(facts, indent=2, sort_keys=True) if as_json else envinfo.format_report(facts))
