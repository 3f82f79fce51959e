"""`labkit notebooks run|check|clean`: execute the labs with papermill, keep them clean for git.

The cores live in `labkit.course.notebooks`; this module parses arguments and prints.
"""
from __future__ import annotations

import glob
from pathlib import Path

import click
import yaml

from labkit.course import notebook_hygiene as hygiene
from labkit.course import notebooks as nbk
from labkit.errors import NotebookError


def _expand(paths: tuple[str, ...], default_globs: tuple[str, ...]) -> list[Path]:
    """Files for `paths`: folders give their notebooks, and a shell glob that matched nothing (bash
    passes `reservations/*.ipynb` through literally when the folder is empty) is dropped."""
    found: list[Path] = []
    for pattern in paths or default_globs:
        path = Path(pattern)
        if path.is_dir():
            found += sorted(path.glob("*.ipynb"))
        elif path.exists():
            found.append(path)
        elif glob.has_magic(pattern):
            found += [Path(p) for p in sorted(glob.glob(pattern))]
        else:
            raise NotebookError(f"no notebook at {pattern}; check the path")
    return found


@click.group()
def command():
    """Run, check and clean the course notebooks."""


@command.command("run", short_help="Execute notebooks with papermill; table of status and seconds.")
@click.argument("names", nargs=-1)
@click.option("--profile", default="smoke", show_default=True, help="Passed to every notebook as PROFILE.")
@click.option("--out", "out_dir", default="build/executed", show_default=True, type=click.Path(file_okay=False),
              help="Where the executed copies go (kept on failure too).")
@click.option("--timeout", "timeout_s", default=nbk.DEFAULT_TIMEOUT_S, show_default=True, type=float,
              help="Seconds one cell may run.")
@click.option("--kernel", default=nbk.KERNEL, show_default=True)
@click.option("-p", "--parameter", "params", multiple=True, type=(str, str), metavar="NAME VALUE",
              help="Extra papermill parameter; VALUE is read as YAML (3 -> int, true -> bool).")
@click.option("--rehearse", is_flag=True,
              help="Rehearse the profile on this machine's CPU: every branch the node takes, stand-in models, "
                   "every run sized at its real size; numbers are not measurements (docs/gpu-node.md).")
@click.option("--write-manifest", is_flag=True,
              help="With --rehearse over all notebooks: store the runs observed as the profile's lab runs "
                   "(labkit/data/lab_runs.json, read by the preflight).")
@click.pass_context
def run(ctx, names, profile, out_dir, timeout_s, kernel, params, rehearse, write_manifest):
    """Execute NAMES (e.g. 01_memory, 01, or a path; all of notebooks/ by default) with papermill.

    Prints a table of notebook, status and seconds; exits 1 if any notebook failed, naming the cell.
    """
    if write_manifest and (not rehearse or names):
        raise click.UsageError("--write-manifest needs --rehearse and every notebook (no NAMES)")
    if not rehearse:
        from labkit.runtime.envinfo import require
        require(profile)  # a GPU profile without its GPUs: one line and exit 2 before any kernel starts
    parameters = {name: yaml.safe_load(value) for name, value in params}
    runs = nbk.run_notebooks(list(names) or None, profile=profile, out_dir=out_dir, timeout_s=timeout_s,
                             kernel=kernel, parameters=parameters, progress=lambda line: click.echo(line, err=True),
                             rehearse=rehearse)
    click.echo(nbk.format_runs(runs))
    if rehearse:
        from labkit.course import rehearse as rh
        from labkit.runtime.rehearsal import BANNER, STEPS
        click.echo(BANNER.format(profile=profile, steps=STEPS), err=True)
        if write_manifest and all(r.ok for r in runs):
            click.echo(f"lab runs of {profile} written to {rh.write_manifest(profile, rh.runs_of(runs))}", err=True)
    failed = [r for r in runs if not r.ok]
    if failed:
        click.echo(f"\n{len(failed)} of {len(runs)} notebooks failed:", err=True)
        for r in failed:
            click.echo(f"  {r.describe()}", err=True)
        ctx.exit(1)


@command.command("check", short_help="Report notebooks that break the hygiene rules.")
@click.argument("paths", nargs=-1)
@click.pass_context
def check(ctx, paths):
    """Hygiene of PATHS (default notebooks/*.ipynb reservations/*.ipynb); exits 1 on any problem."""
    files = _expand(paths, ("notebooks/*.ipynb", "reservations/*.ipynb"))
    bad = 0
    for path in files:
        problems = hygiene.check_hygiene(path)
        bad += bool(problems)
        click.echo(f"{path}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
        for problem in problems:
            click.echo(f"  - {problem}")
    if bad:
        ctx.exit(1)


@command.command("clean", short_help="Strip outputs and execution counts in place.")
@click.argument("paths", nargs=-1, required=True)
def clean(paths):
    """Strip outputs, execution counts and execution metadata from PATHS in place (sources are kept)."""
    for path in _expand(paths, ()):
        stripped = hygiene.clean(path)
        click.echo(f"{path}: " + (f"stripped {', '.join(stripped)}" if stripped else "already clean"))
