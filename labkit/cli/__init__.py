"""`labkit` command line: one module per subcommand, each with a pure core and a thin printer.

Subcommands are imported lazily so `labkit memory estimate` never pays for `import torch`.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys

import click

from labkit.errors import LabkitError

#: subcommand name -> module under labkit.cli defining a click command or group named `command`.
SUBCOMMANDS = {
    "env": "env",
    "train": "train",
    "memory": "memory",
    "fetch": "fetch",
    "notebooks": "notebooks",
    "launch": "launch",
    "plan": "plan",
    "reserve": "reserve",
    "check": "check",
    "grade": "grade",
    "assign": "assign",
    "solution": "solution",
    "site": "site",
    "slides": "slides",
    "bench": "bench",
    "preflight": "preflight",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(n for n, m in SUBCOMMANDS.items()
                      if importlib.util.find_spec(f"labkit.cli.{m}") is not None)

    def get_command(self, ctx, name):
        if name not in SUBCOMMANDS or name not in self.list_commands(ctx):
            return None
        return importlib.import_module(f"labkit.cli.{SUBCOMMANDS[name]}").command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="labkit")
def cli():
    """labkit: train models at scale, from one GPU to 3-D parallelism (CPU smoke profile included)."""


def main(argv=None):
    """Console entry point: LabkitError becomes a one-line message and exit code 2."""
    try:
        code = cli.main(args=argv, prog_name="labkit", standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(1)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except LabkitError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
