"""`labkit plan`: rank the 3-D layouts (dp, tp, pp, ZeRO, micro-batches) of a model on N GPUs.

    labkit plan --model gpt3-175b --gpus 64 --gpus-per-node 8 --gpu a100-80gb
    labkit plan --model gpt3-175b --gpus 64 --gpus-per-node 8 --tp 8 --pp 8 --dp 8   # why not? (exit 2)
    labkit plan --model path/to/config.json --gpus 8192 --gpus-per-node 8 --gpu h100-sxm --tp 8 --pp 16 --dp 64 \\
        --zero 2 --interleave 8 --seq 8192 --batch 2048 --checkpointing none

`--model` takes what `labkit memory estimate` takes: a preset, a Hugging Face id in the local cache, a folder
or a config.json (llama, mistral, qwen2, mixtral, gpt2, gpt_neox, bloom, opt, falcon). --stack, --attention,
--tp-overlap, --optimizer-states and --zero-stages describe the run's software (they reach the time and memory models). Core:
`labkit.parallel.planner` (pure Python, no torch). With --dp/--tp/--pp it checks that one layout and prints
its estimate or the reason it cannot run. Step times come from `labkit.parallel.perf_model` with the
constants fitted to published runs (`labkit.parallel.hardware`); `--matmul-efficiency X` or `--measured FILE`
(a `labkit preflight` measurement) replace the matmul efficiency only when given. The output says which it used.
"""
from __future__ import annotations

import json

import click

from labkit.errors import ConfigError
from labkit.parallel import hardware, planner

#: PlanRequest fields the command passes through.
REQUEST_KEYS = ("model", "gpus", "gpus_per_node", "gpu", "batch", "seq", "checkpointing", "matmul_efficiency",
                "measured", "inter_node_gbps", "interleave", "flash", "sequence_parallel", "precision", "fsdp",
                "stack", "attention", "tp_overlap", "optimizer_states", "zero_stages")


def _zero_stages(ctx, param, value):
    """'0,1,3' -> (0, 1, 3): the ZeRO stages the run's software offers (Megatron-Core: no ZeRO-2)."""
    if value is None:
        return None
    try:
        stages = tuple(sorted({int(v) for v in value.split(",") if v.strip()}))
    except ValueError:
        stages = ()
    if not stages or not set(stages) <= {0, 1, 2, 3}:
        raise click.BadParameter(f"{value!r}; give stages from 0-3 separated by commas, e.g. 0,1,3")
    return stages


def run_plan(*, model: str, gpus: int, gpus_per_node: int, gpu: str = "a100-80gb", top: int = 10, dp=None, tp=None,
             pp=None, zero: int = 0, cp=None, ep=None, **request) -> dict:
    """The pure core: the plan (or one checked layout) as JSON data."""
    req = planner.PlanRequest(model=model, gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu,
                              **{k: v for k, v in request.items() if v is not None})
    if any(v is not None for v in (dp, tp, pp, cp, ep)):
        dp, tp, pp, cp, ep = (v or 1 for v in (dp, tp, pp, cp, ep))
        planner.check_layout(req, dp, tp, pp, zero, cp=cp, ep=ep)  # ConfigError names the reason
        per_replica = req.batch // dp
        options = [planner.evaluate(req, dp, tp, pp, zero, b, cp=cp, ep=ep) for b in planner.MICRO_BATCH_SIZES
                   if per_replica % b == 0 and per_replica // b >= pp]
        if not options:
            raise ConfigError(f"global batch {req.batch} leaves fewer than pp={pp} micro-batches per pipeline; "
                              f"use --batch {dp * pp} or more")
        return {"request": planner.dataclasses.asdict(req), "capacity_gb": req.capacity_bytes / 1e9,
                "assumption": planner.assumption(req),
                "layout": [o.to_dict() for o in sorted(options, key=lambda o: o.step_s)]}
    return planner.plan(req).to_dict(top=top)


def format_layout(data: dict) -> str:
    r = data["request"]
    lines = [f"{r['model']} on {r['gpus']} x {r['gpu']}: valid layout; usable {data['capacity_gb']:.0f} GB/GPU"]
    for o in data["layout"]:
        verdict = "fits" if o["fits"] else f"DOES NOT FIT ({o['overflow']})"
        lines.append(f"  {o['layout']} (micro-batch {o['micro_batch']}): {o['memory_gb']:.1f} GB/GPU {verdict}, "
                     f"bubble {o['bubble']:.3f}, step {o['step_s']:.2f} s, {o['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, "
                     f"mfu {o['mfu']:.2f}, hfu {o['hfu']:.2f}, {o['tflops_per_gpu']:.0f} TFLOPS/GPU, "
                     f"exposed comm s {o['comm_s']}, all DP comm {o['dp_comm_s']:.2f} s")
    a = data["assumption"]
    lines.append(f"assumes {a['precision']} matmuls at {a['matmul_efficiency']:.0%} of the {a['peak_tflops']:.0f} "
                 f"TFLOPS peak ({a['source']}); NCCL at {a['comm_efficiency']:.0%} of NVLink, "
                 f"{a['network_efficiency']:.0%} of {a['inter_node_gbps']:g} Gb/s per GPU between nodes")
    return "\n".join(lines)


@click.command("plan", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", required=True, help="preset (gpt3-175b, llama2-7b), HF id in the local cache, folder or config.json")
@click.option("--gpus", type=int, required=True, help="total GPUs (must equal dp * tp * pp [* cp])")
@click.option("--gpus-per-node", type=int, required=True, help="GPUs per node (the NVLink domain)")
@click.option("--gpu", type=click.Choice(list(hardware.GPUS)), default="a100-80gb",
              show_default=True)
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
@click.option("--zero-stages", callback=_zero_stages, default=None, metavar="0,1,3",
              help="the ZeRO stages the search may try (the stack's: Megatron-Core/NeMo have 0, 1, 3) [0,1,2,3]")
@click.option("--fsdp", is_flag=True, help="ZeRO-3 as torch FSDP (the recompute reuses the backward's gather)")
@click.option("--interleave", type=click.IntRange(1), default=1, show_default=True,
              help="virtual pipeline stages per rank (interleaved 1F1B) when pp > 1")
@click.option("--no-flash", "flash", flag_value=False, default=True, help="the 2021-22 softmax kernels, not flash")
@click.option("--no-sequence-parallel", "sequence_parallel", flag_value=False, default=True,
              help="no sequence parallelism under TP")
@click.option("--precision", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True,
              help="fp8: the linears on FP8 tensor cores (H100/H200/B200), at a stated efficiency")
@click.option("--stack", type=click.Choice(list(hardware.STACKS)), default="megatron", show_default=True,
              help="software stack: megatron (Megatron-Core/NeMo, fused Transformer Engine kernels), torch-compile "
                   "(torch-native under torch.compile), eager (torch-native, one kernel per op); torch-native "
                   "linears run at a fitted share of the fused stack's GEMM rate")
@click.option("--attention", type=click.Choice(list(hardware.ATTENTION_KERNELS)), default=None,
              help="attention kernel: fa2, sdpa (PyTorch's: FA2 on A100/H100, memory-efficient on V100/T4), fa3 "
                   "(FA3 / cuDNN, Hopper+), triton (2022-23 Triton flash), eager (unfused) [fa2; V100/T4: sdpa]")
@click.option("--tp-overlap", is_flag=True,
              help="overlap TP collectives with the GEMMs beside them (--tp-comm-overlap, AsyncTP)")
@click.option("--optimizer-states", type=click.Choice(list(hardware.OPTIMIZER_STATES)), default="fp32",
              show_default=True, help="Adam's moments in fp32 (12 B/param with the master) or bf16 (8 B)")
@click.option("--inter-node-gbps", type=click.FloatRange(0, min_open=True), default=None,
              help="inter-node bandwidth per GPU, Gb/s [the GPU's system: A100 200, H100/H200/B200 400]")
@click.option("--matmul-efficiency", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="share of peak the GEMMs reach [the value fitted to published runs]")
@click.option("--measured", type=click.Path(exists=True, dir_okay=False), default=None,
              help="plan with a node's measured efficiency (the file `labkit preflight` wrote)")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def command(as_json: bool, top: int, **options) -> None:
    """Enumerate and rank (dp, tp, pp, cp, ZeRO stage, micro-batches) for MODEL on GPUS GPUs.

    A layout "does not fit" only when the memory estimator says so with these settings (--optimizer-states,
    --checkpointing, ZeRO over dp x cp); the output names the term that overflows and why others were dropped."""
    if any(options[k] is not None for k in ("dp", "tp", "pp", "cp", "ep")):
        data = run_plan(top=top, **options)
        click.echo(json.dumps(data, indent=1) if as_json else format_layout(data))
        return
    result = planner.plan(planner.PlanRequest(**{k: options[k] for k in REQUEST_KEYS if options[k] is not None}))
    click.echo(json.dumps(result.to_dict(top=top), indent=1) if as_json else planner.format_plan(result, top=top))
