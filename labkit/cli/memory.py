"""`labkit memory estimate|trace|measure`: will it fit? (core: labkit.memory)

All three take the same options and print the same layout (`--json`: params, trainable_params,
per_gpu_bytes{weights, grads, optimizer, activations, total}, cpu_bytes, assumptions). `estimate`
never imports torch. A bad value exits with code 2 and a message naming it.
"""
from __future__ import annotations

import re

import click

from labkit.errors import ConfigError
from labkit.memory.config import (CHECKPOINTING, FSDP_STRATEGIES, OFFLOADS, OPTIMIZERS, PRECISIONS, QUANTS,
                                  MemoryConfig)
from labkit.memory.estimate import Estimate, estimate

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str, option: str = "--params") -> int:
    """'7000000000', '7e9', '7.5B', '175b' -> int."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", str(text).lower())
    if not m:
        raise ConfigError(f"{option} {text!r} is not a parameter count; write e.g. 7000000000, 7e9 or 7B")
    value = float(m.group(1)) * _SUFFIX[m.group(2)]
    if value < 1 or value != round(value):
        raise ConfigError(f"{option} {text!r} must be a positive whole number of parameters")
    value = round(value)
    return int(value)


def config_from_options(*, model=None, params=None, fsdp=None, node_size=0, lora_targets="q_proj,v_proj",
                        zero=None, largest_layer=None, **fields) -> MemoryConfig:
    """The pure core of all three commands: CLI option values -> a validated MemoryConfig."""
    if params is not None:
        params = parse_count(params)
    if largest_layer is not None:
        fields["largest_layer"] = parse_count(largest_layer, "--largest-layer")
    fields = {k: v for k, v in fields.items() if v is not None}
    targets = tuple(t for t in lora_targets.split(",") if t.strip())
    if fsdp is not None:
        if zero is not None:
            raise ConfigError(f"give --zero or --fsdp, not both (--fsdp {fsdp} means ZeRO-{FSDP_STRATEGIES[fsdp]})")
        return MemoryConfig.for_fsdp(fsdp, node_size=node_size, model=model, params=params,
                                     lora_targets=targets, **fields)
    return MemoryConfig(model=model, params=params, zero=zero or 0, lora_targets=targets, **fields)


def run(source: str, cfg: MemoryConfig) -> Estimate:
    """Estimate, trace (fake tensors) or measure (real step) `cfg`."""
    if source == "estimate":
        return estimate(cfg)
    if source == "trace":
        from labkit.memory.dry_run import trace
        return trace(cfg)
    from labkit.memory.measure import measure
    return measure(cfg)


def _options(fn):
    choice = lambda values: click.Choice(list(values))  # noqa: E731
    opts = [
        click.option("--model", help="Preset (e.g. llama2-7b, resnet50) or path of a HF config.json."),
        click.option("--params", help="Parameter count instead of a model, e.g. 7e9 or 7B."),
        click.option("--precision", type=choice(PRECISIONS), help="Default mixed-bf16."),
        click.option("--optimizer", type=choice(OPTIMIZERS), help="Default adamw."),
        click.option("--zero", type=click.IntRange(0, 3), help="ZeRO stage over the dp group (default 0)."),
        click.option("--fsdp", type=choice(FSDP_STRATEGIES), help="FSDP strategy instead of --zero."),
        click.option("--node-size", type=int, default=0, help="GPUs per node for --fsdp hybrid_shard."),
        click.option("--dp", type=int, help="Data-parallel degree (default 1)."),
        click.option("--tp", type=int, help="Tensor-parallel degree (default 1)."),
        click.option("--pp", type=int, help="Pipeline-parallel degree (default 1)."),
        click.option("--cp", type=int, help="Context-parallel degree: GPUs a sequence is split over (default 1)."),
        click.option("--ep", type=int, help="Expert-parallel degree for MoE models, divides dp (default 1)."),
        click.option("--gpus", type=int, help="Total GPUs; must equal dp*tp*pp*cp."),
        click.option("--offload", type=choice(OFFLOADS), help="Default none."),
        click.option("--largest-layer", help="Params of the largest layer ZeRO-3 gathers (offloaded params); "
                     "default: the model's, or params/32 with --params."),
        click.option("--lora-rank", type=int, help="LoRA rank r (0 = full fine-tune)."),
        click.option("--lora-targets", default="q_proj,v_proj", show_default=True,
                     help="Comma-separated linear names (q,v,... or all-linear; q/k/v slice a fused qkv)."),
        click.option("--quant", type=choice(QUANTS), help="Base quantization with LoRA (QLoRA)."),
        click.option("--batch", type=int, help="Samples per GPU per step; omitted = model states only."),
        click.option("--seq", type=int, help="Sequence length (default min(context, 2048))."),
        click.option("--grad-accum", type=int, help="Micro-batches per step (default 1)."),
        click.option("--checkpointing", type=choice(CHECKPOINTING), help="Default none."),
        click.option("--flash/--no-flash", "flash_attention", default=None, help="Fused attention (default on)."),
        click.option("--sequence-parallel", is_flag=True, default=None, help="Megatron SP with --tp."),
        click.option("--json", "as_json", is_flag=True, help="Print only the JSON layout."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _command(source: str, doc: str):
    @_options
    def cmd(as_json: bool, **options) -> None:
        from labkit.zoo.hub import NotCachedError
        try:
            result = run(source, config_from_options(**options))
        except NotCachedError:
            raise  # one line naming `labkit fetch ID` (labkit.cli.main), not a usage error
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from exc  # exit code 2, message names the bad value
        if as_json:
            click.echo(result.to_json())
        else:
            from labkit.memory.report import format_table
            click.echo(format_table(result))
    cmd.__doc__ = doc
    return click.command(source)(cmd)


@click.group("memory")
def command() -> None:
    """Will it fit? Per-GPU training memory: estimate (formulas), trace (fake tensors), measure (real step)."""


command.add_command(_command("estimate", "Estimate per-GPU memory from formulas (no torch, < 1 ms)."))
command.add_command(_command("trace", "Trace one training step on fake tensors (FakeTensorMode + MemTracker)."))
command.add_command(_command("measure", "Measure one real training step on this machine's device."))
