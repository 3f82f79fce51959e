"""`labkit bench comm`: collective bandwidths in nccl-tests' conventions, measured on N ranks.

    labkit bench comm                                       # on a GPU node: every GPU, NCCL, up to 1 GiB
    labkit bench comm --nproc 2 --sizes 1K,64K,1M           # gloo on CPU
    labkit bench comm --json --out /tmp/bench               # JSON, one object per (op, bytes)

Core: `run_comm` (launches `python -m labkit.profiling.commbench` through `labkit.runtime.launch.run`, then reads the
file rank 0 wrote); `labkit.profiling.commbench` has the formulas, the file format and the reader that notebook 03
and the preflight use. Without --out the file is comm_bench.json in the results root ($LABKIT_RUNS, else
runs/), where notebook 03 reads it.
"""
from __future__ import annotations

import json
from dataclasses import asdict

import click

from labkit.profiling import commbench
from labkit.errors import ConfigError


def gpu_count() -> int:
    """CUDA devices of this machine (`labkit.runtime.envinfo`; 0 without CUDA)."""
    from labkit.runtime.envinfo import torch_facts

    return len(torch_facts().get("devices", []))


def run_comm(*, nproc: int | None = None, sizes: str | None = None, ops: str = ",".join(commbench.OPS),
             warmup: int = 5, iters: int = 20, out: str | None = None, timeout_s: float = 600,
             stream: bool = False) -> list[commbench.CommMeasurement]:
    """Measure on `nproc` ranks (default: every GPU of a node, else 2 CPU ranks); returns the rows rank 0 wrote to
    `<out>/comm_bench.json` (default: the results root, `commbench.default_file`)."""
    from labkit.runtime import launch

    if nproc is not None and (not isinstance(nproc, int) or nproc < 2):
        raise ConfigError(f"--nproc {nproc!r}: a collective needs at least 2 ranks; use --nproc 2 or more")
    if nproc is None or sizes is None:  # every GPU and up to 1 GiB on a GPU node (what notebook 03 reads)
        gpus = gpu_count()
        nproc = commbench.default_nproc(gpus) if nproc is None else nproc
        sizes = sizes or commbench.default_sizes(on_gpus=nproc <= gpus)
    if warmup < 0 or iters < 1:
        raise ConfigError(f"--warmup {warmup} --iters {iters}: warm-up must be >= 0 and iterations >= 1")
    bad = [o for o in ops.split(",") if o not in commbench.OPS]
    if bad:
        raise ConfigError(f"unknown collective(s) {', '.join(bad)}; choose from {','.join(commbench.OPS)}")
    parsed = commbench.parse_sizes(sizes, nproc)  # fail here, before any rank starts
    folder = str(out or commbench.default_file().parent)
    from labkit.runtime import rehearsal
    if rehearsal.active():  # the node's ranks, stood in for in this process (labkit.runtime.rehearsal)
        return commbench.load(commbench.rehearse(nproc, parsed, ops.split(","), warmup=warmup, iters=iters, out=folder))
    launch.run("labkit.profiling.commbench", ["--sizes", sizes, "--ops", ops, "--warmup", str(warmup), "--iters", str(iters),
                                    "--out", folder], nproc=nproc, timeout_s=timeout_s, stream=stream)
    return commbench.load(f"{folder}/{commbench.FILE_NAME}")


@click.group("bench", context_settings={"help_option_names": ["-h", "--help"]})
def command() -> None:
    """Micro-benchmarks of the node (collective bandwidth)."""


@command.command("comm")
@click.option("--nproc", type=int, default=None,
              help="ranks [every GPU of a node with 2 or more, else 2 CPU ranks]")
@click.option("--sizes", default=None,
              help=f"message sizes S in bytes, K = 1024 (nccl-tests' S: see labkit.profiling.commbench) "
                   f"[{commbench.GPU_SIZES} on GPUs, {commbench.CPU_SIZES} on CPU]")
@click.option("--ops", default=",".join(commbench.OPS), show_default=True, help="collectives to time")
@click.option("--warmup", type=int, default=5, show_default=True, help="untimed calls per (op, size)")
@click.option("--iters", type=int, default=20, show_default=True, help="timed calls per (op, size)")
@click.option("--out", default=None, help="folder for comm_bench.json [$LABKIT_RUNS, else runs: where notebook 03 reads it]")
@click.option("--plot", "plot_path", default=None, help="also save the bandwidth-vs-size figure (PNG)")
@click.option("--json", "as_json", is_flag=True, help="print JSON: one object per (op, bytes)")
def comm(as_json: bool, plot_path: str | None, **options) -> None:
    """all_reduce, all_gather, reduce_scatter, all_to_all, broadcast: time, algbw and busbw per size."""
    rows = run_comm(**options)
    click.echo(f"# saved to {options['out'] or commbench.default_file().parent}/{commbench.FILE_NAME}; notebook 03 "
               f"and the preflight read {commbench.default_file()}", err=True)
    if plot_path:
        from labkit.viz.collectives import plot_bandwidth

        plot_bandwidth(rows).savefig(plot_path, dpi=120)
    click.echo(json.dumps([asdict(r) for r in rows], indent=1) if as_json else commbench.format_table(rows))
