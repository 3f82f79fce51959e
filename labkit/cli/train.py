"""`labkit train`: one command for every strategy (parser here, core in `labkit.train.api`).

    labkit train --strategy ddp --model tiny-llama --profile smoke --nproc 2 --steps 20 --out runs/ddp

With --nproc > 1 (or a strategy that needs a process group) it launches itself under torchrun via
`labkit.runtime.launch`; rank 0 appends one record to OUT/results.jsonl (default OUT: $LABKIT_RUNS, else runs) and
this command prints its summary.
"""
from __future__ import annotations

import click

from labkit.cli.options import sectioned_command
from labkit.train.config import SECTIONS


# One option per TrainConfig field, help from its docstring, grouped by section (labkit.cli.options).
@sectioned_command("train", SECTIONS, context_settings={"help_option_names": ["-h", "--help"]})
def command(find_max_batch: bool, memory_budget_mb: float | None, **options) -> None:
    """Train MODEL with STRATEGY and append one record to OUT/results.jsonl."""
    if find_max_batch:
        click.echo(format_batch_report(find_batch(options, memory_budget_mb)))
        return
    record = run_training(options)
    if record is not None:
        from labkit.results import summary_line
        click.echo(summary_line(record))
        click.echo(f"losses: {' '.join(f'{x:.4f}' for x in record.losses)}")
        from labkit.results import runs_root
        click.echo(f"record appended to {options['out'] or runs_root()}/results.jsonl")


def run_training(options: dict):
    """The core: `labkit.train.api.run` with the parsed options (tests call it in-process)."""
    from labkit.train.api import run
    return run(**options)


def format_batch_report(report: dict) -> str:
    """Probes one per line, then the answer."""
    budget = report["budget_bytes"]
    lines = [f"max-batch search for {report['model']} on {report['device']} (amp {report['amp']}, "
             f"checkpointing {report['checkpointing']})" + (f", budget {budget / 2**20:.1f} MiB" if budget else "")]
    for batch, peak in report["probes"]:
        verdict = "out of memory" if peak is None else f"peak {peak / 2**20:.1f} MiB" + (
            " (over budget)" if budget and peak > budget else "")
        lines.append(f"  micro-batch {batch:>5}: {verdict}")
    lines.append(f"largest micro-batch that fits: {report['max_micro_batch']}")
    if report.get("safe_micro_batch"):
        lines.append(f"  run at {report['safe_micro_batch']}: 3/4 of it leaves room for what a probe does not "
                     "carry (new cuDNN workspaces, fragmentation)")
    if report.get("limit_reached"):
        lines.append(f"  (every probe up to the limit {report['limit']} fit: the true maximum is larger)")
    return "\n".join(lines)


def find_batch(options: dict, budget_mb: float | None) -> dict:
    from labkit.errors import ConfigError
    from labkit.train.batch_finder import find_max_batch

    if options["strategy"] != "single" or options["nproc"] != 1:
        raise ConfigError("--find-max-batch probes one device: use it with --strategy single --nproc 1; "
                          "the micro-batch it finds also fits each DDP rank")
    keep = ("amp", "checkpointing", "channels_last", "seq_len", "seed")
    return find_max_batch(options["model"], profile=options["profile"], budget_mb=budget_mb,
                          **{k: v for k, v in options.items() if k in keep and v is not None})
