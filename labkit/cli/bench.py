"""`labkit bench comm`: collective bandwidths in nccl-tests' conventions, measured on N ranks.

    labkit bench comm --nproc 2 --sizes 1K,64K,1M          # gloo on CPU, nccl on GPUs
    labkit bench comm --nproc 4 --json --out runs/bench     # JSON, one object per (op, bytes)

Core: `run_comm` (launches `python -m labkit.profiling.commbench` through `labkit.launch.run`, then reads the
file rank 0 wrote); `labkit.profiling.commbench` has the formulas, the file format and the reader that notebook 03
and the preflight use. Without --out the file is ~/.cache/labkit/comm_bench.json.
"""
from __future__ import annotations

import json
from dataclasses import asdict

import click

from labkit.profiling import commbench
from labkit.cache import cache_root
from labkit.errors import ConfigError


def run_comm(*, nproc: int = 2, sizes: str = commbench.DEFAULT_SIZES, ops: str = ",".join(commbench.OPS),
             warmup: int = 5, iters: int = 20, out: str | None = None, timeout_s: float = 600,
             stream: bool = False) -> list[commbench.CommMeasurement]:
    """Measure on `nproc` ranks; returns the rows rank 0 wrote to `<out>/comm_bench.json`."""
    from labkit import launch

    if not isinstance(nproc, int) or nproc < 2:
        raise ConfigError(f"--nproc {nproc!r}: a collective needs at least 2 ranks; use --nproc 2 or more")
    if warmup < 0 or iters < 1:
        raise ConfigError(f"--warmup {warmup} --iters {iters}: warm-up must be >= 0 and iterations >= 1")
    bad = [o for o in ops.split(",") if o not in commbench.OPS]
    if bad:
        raise ConfigError(f"unknown collective(s) {', '.join(bad)}; choose from {','.join(commbench.OPS)}")
    parsed = commbench.parse_sizes(sizes, nproc)  # fail here, before any rank starts
    folder = str(out or cache_root())
    from labkit import rehearsal
    if rehearsal.active():  # the node's ranks, stood in for in this process (labkit.rehearsal)
        return commbench.load(commbench.rehearse(nproc, parsed, ops.split(","), warmup=warmup, iters=iters, out=folder))
    launch.run("labkit.profiling.commbench", ["--sizes", sizes, "--ops", ops, "--warmup", str(warmup), "--iters", str(iters),
                                    "--out", folder], nproc=nproc, timeout_s=timeout_s, stream=stream)
    return commbench.load(f"{folder}/{commbench.FILE_NAME}")


@click.group("bench", context_settings={"help_option_names": ["-h", "--help"]})
def command() -> None:
    """Micro-benchmarks of the node (collective bandwidth)."""


@command.command("comm")
@click.option("--nproc", type=int, default=2, show_default=True, help="ranks (GPUs on a GPU node)")
@click.option("--sizes", default=commbench.DEFAULT_SIZES, show_default=True,
              help="message sizes S in bytes, K = 1024 (nccl-tests' S: see labkit.profiling.commbench)")
@click.option("--ops", default=",".join(commbench.OPS), show_default=True, help="collectives to time")
@click.option("--warmup", type=int, default=5, show_default=True, help="untimed calls per (op, size)")
@click.option("--iters", type=int, default=20, show_default=True, help="timed calls per (op, size)")
@click.option("--out", default=None, help="folder for comm_bench.json [~/.cache/labkit, read by notebook 03]")
@click.option("--plot", "plot_path", default=None, help="also save the bandwidth-vs-size figure (PNG)")
@click.option("--json", "as_json", is_flag=True, help="print JSON: one object per (op, bytes)")
def comm(as_json: bool, plot_path: str | None, **options) -> None:
    """all_reduce, all_gather, reduce_scatter, all_to_all, broadcast: time, algbw and busbw per size."""
    rows = run_comm(**options)
    if plot_path:
        from labkit.viz.figures import plot_bandwidth

        plot_bandwidth(rows).savefig(plot_path, dpi=120)
    click.echo(json.dumps([asdict(r) for r in rows], indent=1) if as_json else commbench.format_table(rows))
