"""`labkit train`: one command for every strategy (parser here, core in `labkit.train.api`).

    labkit train --strategy ddp --model tiny-llama --profile smoke --nproc 2 --steps 20 --out runs/ddp

With --nproc > 1 (or a strategy that needs a process group) it launches itself under torchrun via
`labkit.launch`; rank 0 appends one record to OUT/results.jsonl and this command prints its summary.
"""
from __future__ import annotations

import click

from labkit.train.config import AMP_MODES
from labkit.optim import OPTIMIZERS

# Option name -> TrainConfig field, for the options whose names differ.
_RENAME = {"deadline_margin": "deadline_margin_s"}


@click.command("train", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--strategy", required=True, help="single, ddp, fsdp, zero2, lora, pipeline-1f1b, ... (see labkit.parallel)")
@click.option("--model", required=True, help="tiny-resnet, tiny-llama, resnet50, tinyllama-1.1b, ..., a local LLM folder or a cached HF id ORG/NAME")
@click.option("--profile", default="smoke", show_default=True, help="smoke, a100x1, a100x4, h100x1, v100x4")
@click.option("--nproc", type=int, default=1, show_default=True, help="ranks per node (> 1 runs under torchrun)")
@click.option("--steps", type=int, default=None, help="optimizer steps [profile]")
@click.option("--out", default="runs", show_default=True, help="folder for results.jsonl and checkpoints/")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--amp", type=click.Choice(AMP_MODES), default=None, help="mixed precision [profile dtype]")
@click.option("--accum", type=int, default=1, show_default=True, help="gradient-accumulation micro-batches")
@click.option("--microbatches", type=int, default=None, help="pipeline micro-batches per step [2 x stages]")
@click.option("--checkpointing", is_flag=True, help="activation checkpointing")
@click.option("--batch", type=int, default=None, help="GLOBAL batch over all ranks and micro-batches [profile]")
@click.option("--deadline", default=None, help="ISO time with offset (lease end): checkpoint and stop before it")
@click.option("--deadline-margin", type=float, default=None, help="seconds before the deadline [max(60, 2 x save)]")
@click.option("--resume", is_flag=True, help="continue from the newest complete checkpoint in OUT")
@click.option("--checkpoint-every", type=int, default=0, show_default=True, help="DCP checkpoint every K steps")
@click.option("--lr", type=float, default=None, help="learning rate [profile]")
@click.option("--channels-last", is_flag=True, help="NHWC memory format (image models)")
@click.option("--compile", "compile_", is_flag=True, help="torch.compile the model")
@click.option("--find-max-batch", is_flag=True, help="find the largest micro-batch that fits, then exit")
@click.option("--memory-budget-mb", type=float, default=None, help="budget for --find-max-batch on CPU")
@click.option("--eval-at-start", is_flag=True, help="also evaluate the held-out batches before the first step")
@click.option("--memory-cap-gb", type=float, default=None,
              help="train as if the device had this many GB (CUDA allocator limit; CPU: tracked peak)")
@click.option("--data", default="synthetic", show_default=True, help="synthetic, tiny, food11, dolly (labkit fetch), or a local ImageFolder dir / text file")
@click.option("--nnodes", type=int, default=1, show_default=True, help="nodes (torchrun rendezvous)")
@click.option("--node-rank", type=int, default=0, show_default=True)
@click.option("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous when --nnodes > 1")
@click.option("--optimizer", type=click.Choice(list(OPTIMIZERS)), default=None,
              help="optimizer state format (adamw-8bit: Dettmers et al. 2022) [adamw; qlora: paged-adamw-8bit]")
@click.option("--lora-rank", type=int, default=8, show_default=True, help="LoRA rank r (lora, qlora)")
@click.option("--lora-alpha", type=float, default=16.0, show_default=True, help="LoRA scale alpha (update x alpha/r)")
@click.option("--lora-dropout", type=float, default=0.0, show_default=True, help="dropout on the LoRA input")
@click.option("--lora-targets", default="q,v", show_default=True, help="layers LoRA adapts: q,v | q,k,v,o | all-linear")
@click.option("--lora-parallel", type=click.Choice(["ddp", "fsdp"]), default="ddp", show_default=True,
              help="how lora spreads over --nproc > 1 ranks")
@click.option("--trace-steps", type=int, default=0, show_default=True,
              help="record N steps with torch.profiler into OUT/profiles/<run id>/ (docs/profiling.md)")
@click.option("--trace-with", type=click.Choice(["torch", "nsys"]), default="torch", show_default=True,
              help="torch: trace files; nsys: only mark the steps for `nsys profile` (GPU)")
def command(compile_: bool, find_max_batch: bool, memory_budget_mb: float | None, **options) -> None:
    """Train MODEL with STRATEGY and append one record to OUT/results.jsonl."""
    options = {_RENAME.get(k, k): v for k, v in options.items()}
    options["compile"] = compile_
    if find_max_batch:
        click.echo(format_batch_report(find_batch(options, memory_budget_mb)))
        return
    record = run_training(options)
    if record is not None:
        from labkit.results import summary_line
        click.echo(summary_line(record))
        click.echo(f"losses: {' '.join(f'{x:.4f}' for x in record.losses)}")
        click.echo(f"record appended to {options['out']}/results.jsonl")


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
