"""Measurement and orchestration around the strategies: several runs in one launch, the FSDP wrap
study, measured vs estimated model-state bytes, and the optimizer-state bytes of low-bit optimizers.

The strategy modules (`fsdp.py`, `zero.py`, `pipeline.py`, `stack.py`, ...) hold what a strategy IS:
`apply_<x>` and its hook. What a notebook does WITH them -- train several in one torchrun job, compare
their bytes with `labkit.memory.estimate`, study a knob -- lives here. Introduced in notebooks 04_fsdp
(`sweep`, `wrap_study`, `compare_with_estimate`), 05_zero, 07_model_parallel (`run_together`) and
08_profiling_and_stacking (`optimizer_memory`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from labkit.memory.runs import ESTIMATE_FIELDS  # registry name -> the estimator's fields (notebooks 04, 05)
from labkit.parallel import fsdp
from labkit.train.metrics import tensor_bytes


# ------------------------------------------------------------------------ FSDP sweeps and the wrap study
def sweep(runs: list, model: str, *, nproc: int = 2, out: str = "runs", stream: bool = True,
          timeout_s: float | None = None, wrap_policies: dict | None = None, **options) -> list:
    """Train each run in turn inside ONE torchrun job; returns their RunRecords, in order.

    `runs` holds strategy names or (strategy, {option: value}) pairs overriding `options` for one run
    (e.g. ("fsdp", {"amp": "bf16"})): `labkit.train.many.run_many`. With `wrap_policies` the job
    first runs the wrap study (see `wrap_study`); `wrap_rows(out)` reads it.
    """
    from labkit.train.many import run_many

    before = None
    if wrap_policies:
        spec = dict(policies=wrap_policies, out=str(Path(out) / "wrap_study.json"))
        before = ("labkit.parallel.studies:wrap_study_rank", spec)
    return run_many(runs, model, nproc=nproc, out=out, stream=stream, timeout_s=timeout_s, before=before, **options)


def wrap_study(policies: dict[str, dict], model: str = "tiny-llama", *, out: str = "runs", **options) -> list[dict]:
    """Measure each wrap policy on `nproc` ranks: FSDP units, the largest unit, and the peak bytes of
    parameters a rank holds during one forward (its shards + whatever is gathered at that moment).

    `policies` maps a label to FsdpPlan changes, e.g. {"block": {}, "root": {"wrap": "root"},
    "size": {"wrap": "size", "min_num_params": 20_000}}.
    """
    sweep([], model, out=out, wrap_policies=policies, **{"stream": False, **options})
    return wrap_rows(out)


def wrap_rows(out: str) -> list[dict]:
    """The rows the last wrap study wrote to OUT/wrap_study.json."""
    return json.loads((Path(out) / "wrap_study.json").read_text(encoding="utf-8"))


def wrap_study_rank(spec: dict, cfg, ctx) -> None:
    """`run_many` hook on every rank: measure spec["policies"], rank 0 writes the rows to spec["out"]."""
    rows = _wrap_rows(spec["policies"], cfg, ctx)
    if ctx.is_main:
        Path(spec["out"]).parent.mkdir(parents=True, exist_ok=True)
        Path(spec["out"]).write_text(json.dumps(rows), encoding="utf-8")


def _wrap_rows(policies: dict, cfg, ctx) -> list[dict]:
    from labkit.zoo.models import build_llm

    rows = []
    tokens = torch.arange(cfg.optim.batch // ctx.world_size * cfg.run.seq_len).reshape(-1, cfg.run.seq_len).to(ctx.device)
    for label, changes in policies.items():
        plan = fsdp.plan_for("fsdp", **changes)
        model = build_llm(cfg.run.model, seed=cfg.run.seed).to(ctx.device)
        sizes = fsdp.unit_sizes(model, fsdp.wrap_units(model, plan.wrap, plan.min_num_params))
        fsdp.apply_fsdp(model, fsdp.build_mesh(plan, ctx.device, ctx.world_size), cfg=cfg, plan=plan)
        peak = [0]

        def probe(*_):  # registered params are the shards, or the full tensors of gathered units
            peak[0] = max(peak[0], sum(tensor_bytes(model.parameters(), ctx.device)))

        handles = [m.register_forward_pre_hook(probe) for m in model.modules()]
        handles += [m.register_forward_hook(probe) for m in model.modules()]
        model(tokens % model.config.vocab_size).logits.float().mean().backward()
        for h in handles:
            h.remove()
        rows.append(dict(policy=label, units=len(sizes), unit_params=sizes, largest_unit_params=max(sizes),
                         shard_bytes=sum(tensor_bytes(model.parameters(), ctx.device)), peak_param_bytes=peak[0]))
    return rows


# ------------------------------------------------------------------------------ several strategies, one launch
def run_together(strategies, model: str, *, nproc: int = 2, stream: bool = False, **options) -> list:
    """Train `model` with each strategy in turn inside ONE torchrun launch: the same loop and
    RunRecords as `labkit train`, one process start-up instead of several (notebook 07 runs GPipe,
    1F1B and tensor-fsdp this way). `options` are TrainConfig fields shared by all runs.
    A thin name for `labkit.train.many.run_many`."""
    from labkit.train.many import run_many

    return run_many(list(strategies), model, nproc=nproc, stream=stream, **options)


# ------------------------------------------------------------------------------------------ estimate


def estimate_for(record, *, node_size: int | None = None) -> dict:
    """`labkit.memory.estimate` for the configuration of a RunRecord: bytes per rank of weights,
    grads, optimizer, their sum (`model_states`) and host bytes (`cpu`).

    One measured fact the estimator's fp32 row does not contain is added here, visibly
    (`ds_master_copy`): DeepSpeed always steps a separate fp32 master partition, even for fp32 params
    (stage_1_and_2.py clones `weights_partition`; stage3.py clones `fp32_partitioned_groups_flat`),
    so its optimizer holds 4 B more per parameter and rank. Mixed precision already counts a master.
    FSDP2's CPUOffloadPolicy is not ZeRO-Offload: it keeps exactly the ZeRO-3 shards (params, grads,
    optimizer states) on the host and steps them there, with no extra fp32 gradient copy.
    """
    from labkit.memory.estimate import MemoryConfig, estimate

    fields = dict(ESTIMATE_FIELDS[record.strategy])
    if record.strategy == "fsdp-hybrid":
        fields["zero_group"] = node_size or ((record.sharding and record.sharding.mesh_shape) or [record.world_size])[-1]
    deepspeed = record.strategy.startswith("zero")
    # torch strategies keep fp32 params under autocast / MixedPrecisionPolicy; DeepSpeed casts the model.
    precision = "fp32" if record.dtype == "float32" or not deepspeed else \
        {"bfloat16": "mixed-bf16", "float16": "mixed-fp16"}[record.dtype]
    est = estimate(MemoryConfig(model=record.model, precision=precision, dp=record.world_size, **fields))
    master = math.ceil(est.trainable_params * 4 / record.world_size) if deepspeed and precision == "fp32" else 0
    optimizer = est.optimizer + (0 if fields.get("offload") else master)
    cpu = est.cpu_bytes + (master if fields.get("offload") else 0)
    parts = {"weights": est.weights, "grads": est.grads, "optimizer": optimizer}
    if record.strategy == "fsdp-offload":
        cpu, parts = sum(parts.values()), dict.fromkeys(parts, 0)
    return {**parts, "cpu": cpu, "model_states": sum(parts.values()), "ds_master_copy": master}


def compare_with_estimate(records) -> list[dict]:
    """One row per record: measured vs estimated bytes per rank (max over ranks). `ratio` compares
    model states on the device, or for offload runs the host bytes (the estimate keeps only one
    gathered layer on the GPU, which on a CPU run is the same memory as the host)."""
    rows = []
    for r in records:
        est = estimate_for(r)
        measured = max(p + g + o for p, g, o in zip(r.param_bytes, r.grad_bytes, r.optimizer_bytes))
        host = max(r.cpu_offload_bytes or [0])
        offload = r.strategy.endswith("offload")
        mine, theirs = (host, est["cpu"]) if offload else (measured, est["model_states"])
        rows.append(dict(strategy=r.strategy, measured_states=measured, estimated_states=est["model_states"],
                         measured_cpu=host, estimated_cpu=est["cpu"], ds_master_copy=est["ds_master_copy"],
                         compared="host bytes" if offload else "model states", ratio=round(mine / theirs, 3)))
    return rows


# ---------------------------------------------------------------------------- low-bit optimizers
#: name -> (module, class) of the optimizers compared in notebook 08; torchao's are optional.
LOW_BIT_OPTIMIZERS = {
    "torch AdamW (fp32 states)": ("torch.optim", "AdamW"),
    "bitsandbytes AdamW8bit": ("bitsandbytes.optim", "AdamW8bit"),
    "bitsandbytes PagedAdamW8bit": ("bitsandbytes.optim", "PagedAdamW8bit"),
    "torchao AdamW8bit": ("torchao.optim", "AdamW8bit"),
    "torchao AdamW4bit": ("torchao.optim", "AdamW4bit"),
}


def _state_bytes(optimizer) -> int:
    tensors = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(tensor_bytes(tensors, torch.device("cpu")))


def optimizer_memory(model_name: str = "tiny-llama", *, seed: int = 0, min_8bit_size: int = 4096) -> list[dict]:
    """Optimizer-state bytes after one real full fine-tuning step of `model_name`, per optimizer.

    Rows for a library that is not installed say so (`available` False) instead of a number.
    """
    import importlib
    import warnings

    from labkit.zoo.models import build_llm

    rows = []
    for label, (module, cls_name) in LOW_BIT_OPTIMIZERS.items():
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError) as exc:
            rows.append({"optimizer": label, "available": False, "state_bytes": None, "bytes_per_param": None,
                         "note": f"{module.split('.')[0]} not installed ({type(exc).__name__}): pip install "
                                 f"{module.split('.')[0]}"})
            continue
        model = build_llm(model_name, seed=seed)
        params = [p for p in model.parameters()]
        kwargs = {"min_8bit_size": min_8bit_size} if module.startswith("bitsandbytes") else {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Paged optimizers are not supported")
            opt = cls(params, lr=1e-3, **kwargs)
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        n = sum(p.numel() for p in params)
        rows.append({"optimizer": label, "available": True, "state_bytes": _state_bytes(opt),
                     "bytes_per_param": _state_bytes(opt) / n, "note": ""})
    return rows
