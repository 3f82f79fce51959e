"""`labkit plan`: rank the 3-D layouts (dp, tp, pp, ZeRO, micro-batches) of a model on N GPUs.

    labkit plan --model gpt3-175b --gpus 64 --gpus-per-node 8 --gpu a100-80gb
    labkit plan --model gpt3-175b --gpus 64 --gpus-per-node 8 --tp 8 --pp 8 --dp 8   # why not? (exit 2)

Core: `labkit.parallel.planner` (pure Python, no torch). With --dp/--tp/--pp it checks that one layout and
prints its estimate or the reason it cannot run. Step times come from `labkit.parallel.perf_model`: matmuls at an
achievable share of peak (`--matmul-efficiency`, else the node's measurement in
~/.cache/labkit/matmul_efficiency.json or $LABKIT_MATMUL_FILE, else the published-runs default); the
output says which it used.
"""
from __future__ import annotations

import json

import click

from labkit.parallel import planner
from labkit.errors import ConfigError


def run_plan(*, model: str, gpus: int, gpus_per_node: int, gpu: str, batch=None, seq=None, top: int = 10,
             dp=None, tp=None, pp=None, zero: int = 0, checkpointing: str = "full",
             matmul_efficiency: float | None = None, cp=None, ep=None) -> dict:
    """The pure core: the plan (or one checked layout) as JSON data."""
    req = planner.PlanRequest(model=model, gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, batch=batch, seq=seq,
                              checkpointing=checkpointing, matmul_efficiency=matmul_efficiency)
    if any(v is not None for v in (dp, tp, pp, cp, ep)):
        dp, tp, pp, cp, ep = (v or 1 for v in (dp, tp, pp, cp, ep))
        planner.check_layout(req, dp, tp, pp, zero, cp=cp, ep=ep)  # ConfigError names the reason
        options = [planner.evaluate(req, dp, tp, pp, zero, b, cp=cp, ep=ep) for b in planner.MICRO_BATCH_SIZES
                   if (req.batch // dp) % b == 0 and (req.batch // dp) // b >= pp]
        if not options:
            raise ConfigError(f"global batch {req.batch} leaves fewer than pp={pp} micro-batches per pipeline; "
                              f"use --batch {dp * pp} or more")
        return {"request": planner.dataclasses.asdict(req), "capacity_gb": req.capacity_bytes / 1e9,
                "assumption": planner.assumption(req),
                "layout": [o.to_dict() for o in sorted(options, key=lambda o: o.step_s)]}
    return planner.plan(req).to_dict(top=top)


def format_layout(data: dict) -> str:
    lines = [f"{data['request']['model']} on {data['request']['gpus']} x {data['request']['gpu']}: valid layout; "
             f"usable {data['capacity_gb']:.0f} GB/GPU"]
    for o in data["layout"]:
        verdict = "fits" if o["fits"] else "DOES NOT FIT"
        lines.append(f"  {o['layout']} (micro-batch {o['micro_batch']}): {o['memory_gb']:.1f} GB/GPU {verdict}, "
                     f"bubble {o['bubble']:.3f}, step {o['step_s']:.2f} s, mfu {o['mfu']:.2f}, hfu {o['hfu']:.2f}, "
                     f"{o['tflops_per_gpu']:.0f} TFLOPS/GPU, comm s {o['comm_s']}")
    a = data["assumption"]
    lines.append(f"assumes matmuls at {a['matmul_efficiency']:.0%} of the {a['peak_tflops']:.0f} TFLOPS peak "
                 f"({a['source']})")
    return "\n".join(lines)


@click.command("plan", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", required=True, help="LLM or GPT preset, e.g. gpt3-175b, llama2-7b")
@click.option("--gpus", type=int, required=True, help="total GPUs (must equal dp * tp * pp)")
@click.option("--gpus-per-node", type=int, required=True, help="GPUs per node (the NVLink domain)")
@click.option("--gpu", type=click.Choice(list(planner.GPUS)), default="a100-80gb", show_default=True)
@click.option("--batch", type=int, default=None, help="GLOBAL batch in sequences [8 x gpus]")
@click.option("--seq", type=int, default=None, help="tokens per sequence [min(context, 2048)]")
@click.option("--checkpointing", type=click.Choice(["full", "selective", "none"]), default="full", show_default=True)
@click.option("--top", type=int, default=10, show_default=True, help="layouts to show")
@click.option("--dp", type=int, default=None, help="check one layout instead of ranking all")
@click.option("--tp", type=int, default=None)
@click.option("--pp", type=int, default=None)
@click.option("--cp", type=int, default=None, help="context-parallel degree (ring attention) with --dp/--tp/--pp")
@click.option("--ep", type=int, default=None, help="expert-parallel degree (MoE models) with --dp/--tp/--pp")
@click.option("--zero", type=click.IntRange(0, 3), default=0, show_default=True, help="ZeRO stage with --dp/--tp/--pp")
@click.option("--matmul-efficiency", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="share of peak the GEMMs reach [the node's measurement, else the published-runs default]")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def command(as_json: bool, top: int, **options) -> None:
    """Enumerate and rank (dp, tp, pp, ZeRO stage, micro-batches) for MODEL on GPUS GPUs."""
    if any(options[k] is not None for k in ("dp", "tp", "pp", "cp", "ep")):
        data = run_plan(top=top, **options)
        click.echo(json.dumps(data, indent=1) if as_json else format_layout(data))
        return
    keys = ("model", "gpus", "gpus_per_node", "gpu", "batch", "seq", "checkpointing", "matmul_efficiency")
    result = planner.plan(planner.PlanRequest(**{k: options[k] for k in keys}))
    click.echo(json.dumps(result.to_dict(top=top), indent=1) if as_json else planner.format_plan(result, top=top))
