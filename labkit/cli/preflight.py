"""`labkit preflight --profile P [--json]`: prove a node ready for the labs (core: `labkit.course.preflight`).

    labkit preflight --profile a100x4            # on the node, the day before the lab
    labkit preflight --profile smoke --json      # CI: every strategy of `labkit train` on CPU
    labkit preflight --profile h100x1 --steps 2 --strategies ddp   # a slice (make gpu-check)

One line per check (status, seconds, peak, and the fix for a failure); exit 0 only if all pass, 1 if
any failed, 2 when the machine lacks the profile's GPUs. Safe to rerun in the same folder (each run has its
own run id). OUT keeps everything it measured: preflight.json, probes.json, comm_bench.json and
matmul_efficiency.json; no shared cache is written, so `labkit plan` keeps its fitted efficiency.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import sys

import click


@click.command("preflight", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--profile", default="smoke", show_default=True, help="smoke, smoke-bf16, a100x1, a100x4, h100x1, v100x4")
@click.option("--out", default=None, help="folder for preflight.json and the runs [build/preflight/PROFILE]")
@click.option("--steps", type=int, default=3, show_default=True, help="optimizer steps per strategy")
@click.option("--burn-in", "burn_in_s", type=click.FloatRange(0, 60), default=0, show_default=True,
              help="seconds of dense matmuls on every GPU before judging them (a GPU that throttles once hot)")
@click.option("--strategies", default=None, metavar="NAME[,NAME]",
              help="train only these strategies' runs (a quick slice, e.g. `make gpu-check`'s ddp); all by default")
@click.option("--json", "as_json", is_flag=True, help="print a JSON list of checks instead of lines")
@click.pass_context
def command(ctx, profile: str, out: str | None, steps: int, burn_in_s: float, strategies: str | None,
            as_json: bool) -> None:
    """Train every (strategy, precision, variant) the profile's labs use for a few steps, probe all-reduce
    and matmul against the node's expected numbers, and check that every lab's runs resolve and fit;
    exit 0 only if all pass."""
    from labkit.course import preflight

    folder = out or f"build/preflight/{profile}"
    chosen = chosen_strategies(profile, strategies)
    with contextlib.redirect_stdout(sys.stderr):  # the runs' own messages must not mix into --json
        checks = preflight.run(profile, out=folder, steps=steps, burn_in_s=burn_in_s, strategies=chosen)
    if as_json:
        click.echo(json.dumps([dataclasses.asdict(c) for c in checks], indent=1))
    else:
        for check in checks:
            click.echo(check.line())
        bad = sum(c.status != "ok" for c in checks)
        click.echo(f"{len(checks) - bad} of {len(checks)} checks ok; details in {folder}/{preflight.RESULT_FILE}")
    if not preflight.passed(checks):
        ctx.exit(1)


def chosen_strategies(profile: str, names: str | None) -> tuple[str, ...] | None:
    """--strategies a,b as a tuple (None: all); a name the profile's labs do not train is a ConfigError naming
    the ones they do."""
    from labkit.course import preflight
    from labkit.errors import choices_error
    from labkit.profiles import get_profile

    if names is None:
        return None
    chosen = tuple(n.strip() for n in names.split(",") if n.strip())
    trained = {s for s, _, _ in preflight.runs_for(get_profile(profile))}
    for name in chosen:
        if name not in trained:
            raise choices_error("strategy", name, trained)
    return chosen
