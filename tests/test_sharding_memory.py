"""Sharding on 2 gloo ranks, fp32: losses equal DDP's, per-rank bytes fall by stage, estimates agree.

All runs of this file, tests/test_fsdp.py and tests/test_zero.py come from ONE torchrun job
(`labkit.parallel.studies.sweep`, shared through `sweep_records`), so ranks start only once.
"""
from __future__ import annotations

import json
import os

import pytest

STEPS = 3
#: (key, strategy, options): every run the three sharding test files look at.
RUNS = [
    ("ddp", "ddp", {}), ("fsdp", "fsdp", {}), ("fsdp-grad-op", "fsdp-grad-op", {}),
    ("fsdp-no-shard", "fsdp-no-shard", {}), ("fsdp-hybrid", "fsdp-hybrid", {}),
    ("fsdp-offload", "fsdp-offload", {}), ("zero1", "zero1", {}), ("zero2", "zero2", {}),
    ("zero3", "zero3", {}), ("zero3-offload", "zero3-offload", {}),
    ("ddp-accum", "ddp", {"accum": 2}), ("fsdp-accum", "fsdp", {"accum": 2}), ("zero2-accum", "zero2", {"accum": 2}),
    ("fsdp-bf16", "fsdp", {"amp": "bf16"}),
    ("fsdp-ckpt", "fsdp", {"model": "{ckpt}"}), ("ddp-ckpt", "ddp", {"model": "{ckpt}"}),
    ("zero3-save", "zero3", {"out": "{tmp}/z3resume", "checkpoint_every": 2}),
    ("zero3-resume", "zero3", {"out": "{tmp}/z3resume", "resume": True}),
]
DP = 2
WRAP_POLICIES = {"root": {"wrap": "root"}, "block": {}, "size": {"wrap": "size", "min_num_params": 8_000}}


def sweep_records(tmp_path_factory) -> dict:
    """key -> RunRecord of RUNS; run once per pytest session (cached in the session's temp folder)."""
    from labkit import results
    from labkit.zoo.models import save_llm
    from labkit.parallel.studies import sweep

    root = tmp_path_factory.getbasetemp() / "sharding_sweep"
    index = root / "index.json"
    if not index.exists():
        root.mkdir(exist_ok=True)
        ckpt = save_llm("tiny-llama", root / "ckpt", seed=0)
        runs = [(name, {k: v.format(ckpt=ckpt, tmp=root) if isinstance(v, str) else v for k, v in opts.items()})
                for _, name, opts in RUNS]
        # DeepSpeed's JIT-built ops (cpu_adam, shm_comm): the same cache as `make test` uses.
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_repo() / "build" / "torch_extensions"))
        records = sweep(runs, "tiny-llama", nproc=DP, out=str(root / "runs"), steps=STEPS, progress=False,
                        stream=False, wrap_policies=WRAP_POLICIES)
        index.write_text(json.dumps({key: r.to_dict() for (key, _, _), r in zip(RUNS, records)}))
    return {k: results.RunRecord.from_dict(v) for k, v in json.loads(index.read_text()).items()}


def wrap_rows(tmp_path_factory) -> dict:
    """policy -> the wrap-study row the shared sweep measured first."""
    from labkit.parallel.studies import wrap_rows as read

    sweep_records(tmp_path_factory)
    return {row["policy"]: row for row in read(str(tmp_path_factory.getbasetemp() / "sharding_sweep" / "runs"))}


def _repo():
    from pathlib import Path
    return Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    return sweep_records(tmp_path_factory)


def ratio(rec, key: str, field: str, base: str = "ddp") -> float:
    return max(getattr(rec[key], field)) / max(getattr(rec[base], field))


# ------------------------------------------------------------------------------------------ losses
@pytest.mark.slow
@pytest.mark.parametrize("key", ["fsdp", "fsdp-grad-op", "fsdp-no-shard", "fsdp-hybrid", "fsdp-offload",
                                 "zero1", "zero2", "zero3"])
def test_losses_match_ddp(rec, key):
    import numpy as np
    assert len(rec[key].losses) == STEPS
    np.testing.assert_allclose(rec[key].losses, rec["ddp"].losses, rtol=1e-5)


@pytest.mark.slow
def test_training_makes_progress(rec):
    assert rec["ddp"].losses[-1] < rec["ddp"].losses[0]


@pytest.mark.slow
def test_zero3_offload_with_cpu_adam_matches_ddp(rec):
    """DeepSpeedCPUAdam (a C++ AdamW) reaches the same losses up to float rounding."""
    import numpy as np
    assert rec["zero3-offload"].sharding.ds_optimizer == "DeepSpeedCPUAdam"
    np.testing.assert_allclose(rec["zero3-offload"].losses, rec["ddp"].losses, rtol=1e-4)


# ------------------------------------------------------------------------------------------ bytes
@pytest.mark.slow
@pytest.mark.parametrize("key,param,grad", [
    ("ddp", 1.0, 1.0), ("fsdp-no-shard", 1.0, 1.0), ("zero1", 1.0, 1.0),
    ("zero2", 1.0, 0.5), ("fsdp-grad-op", 1.0, 0.5),  # grad-op holds all gathered params fwd -> bwd
    ("fsdp", 0.5, 0.5), ("fsdp-hybrid", 0.5, 0.5), ("zero3", 0.5, 0.5),
])
def test_params_and_grads_per_rank(rec, key, param, grad):
    assert ratio(rec, key, "param_bytes") == pytest.approx(param, rel=0.05)
    # ZeRO-2/3 also hold one reduce bucket (hidden^2 elements): ~8 % of the tiny model's gradients.
    assert ratio(rec, key, "grad_bytes") == pytest.approx(grad, rel=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["fsdp-grad-op", "fsdp", "fsdp-hybrid", "zero1", "zero2", "zero3"])
def test_optimizer_states_halved(rec, key):
    """Adam moments are 1/2 of DDP's from stage 1 on; DeepSpeed adds its fp32 master partition (4 B/N)."""
    r = rec[key]
    master = r.memory.master_copy_bytes or 0
    assert master == (pytest.approx(max(rec["ddp"].param_bytes) / DP, rel=0.01) if key.startswith("zero") else 0)
    assert (max(r.optimizer_bytes) - master) / max(rec["ddp"].optimizer_bytes) == pytest.approx(0.5, rel=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["fsdp-offload", "zero3-offload"])
def test_offload_records_host_bytes(rec, key):
    r = rec[key]
    states = [p + g + o for p, g, o in zip(r.param_bytes, r.grad_bytes, r.optimizer_bytes)]
    # On a CPU run host and device are one memory: the record says so and counts what the policy holds.
    assert r.memory.offload_physical is False
    assert r.cpu_offload_bytes == states
    assert min(r.cpu_offload_bytes) >= max(r.optimizer_bytes) > 0
    assert rec["fsdp"].cpu_offload_bytes == [0, 0] and rec["zero3"].cpu_offload_bytes == [0, 0]


@pytest.mark.slow
def test_measured_bytes_agree_with_estimator(rec):
    from labkit.parallel.studies import compare_with_estimate

    keys = ["ddp", "fsdp", "fsdp-grad-op", "fsdp-no-shard", "fsdp-hybrid", "fsdp-offload",
            "zero1", "zero2", "zero3", "zero3-offload"]
    rows = compare_with_estimate([rec[k] for k in keys])
    assert [row["strategy"] for row in rows] == keys
    for row in rows:
        assert 0.9 <= row["ratio"] <= 1.1, row
    # the offload rows compare host bytes, and those are the estimator's ZeRO-3 shards on the host
    assert {row["strategy"]: row["compared"] for row in rows}["zero3-offload"] == "host bytes"
