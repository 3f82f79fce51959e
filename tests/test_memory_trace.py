"""Estimate vs trace (FakeTensorMode + MemTracker) vs measure (real CPU step) agree.

Tolerances from the memory issue: weights + grads + optimizer within 2 %, activations within 15 %.
Tiny models and one mid-size preset here; every preset (Llama-2-7B included) in bench/memory_trace.py.
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from labkit.cli.memory import command
from labkit.errors import ConfigError
from labkit.memory.estimate import MemoryConfig, estimate
from labkit.memory.measure import measure
from labkit.memory.dry_run import trace

CASES = {
    "tiny-llama fp32": dict(model="tiny-llama", precision="fp32", batch=2, seq=32),
    "tiny-llama mixed-bf16": dict(model="tiny-llama", precision="mixed-bf16", batch=2, seq=64),
    "tiny-llama bf16 eager": dict(model="tiny-llama", precision="bf16", batch=2, seq=64, flash_attention=False),
    "tiny-llama full ckpt": dict(model="tiny-llama", precision="fp32", batch=2, seq=64, checkpointing="full"),
    "tiny-llama lora": dict(model="tiny-llama", precision="bf16", batch=4, seq=64, lora_rank=4,
                            lora_targets=("q_proj", "v_proj", "down_proj")),
    "tiny-llama sgd-momentum accum": dict(model="tiny-llama", precision="fp32", batch=4, seq=64,
                                          optimizer="sgd-momentum", grad_accum=2),
    "tiny-resnet fp32": dict(model="tiny-resnet", precision="fp32", batch=4),
    "resnet50 bf16": dict(model="resnet50", precision="bf16", batch=2),
    "llama3.2-1b mixed ckpt": dict(model="llama3.2-1b", precision="mixed-bf16", batch=1, seq=256,
                                   checkpointing="full"),
}


def assert_agree(est, other):
    assert est.model_states == pytest.approx(other.model_states, rel=0.02)
    assert est.activations == pytest.approx(other.activations, rel=0.15)
    assert est.params == other.params and est.trainable_params == other.trainable_params


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_agrees_with_trace(case):
    cfg = MemoryConfig(**CASES[case])
    traced = trace(cfg)
    assert traced.source == "trace" and traced.activations > 0
    assert_agree(estimate(cfg), traced)
    # the observed peak covers the model states plus at least what the backward pass still holds
    assert traced.total >= traced.model_states


@pytest.fixture(scope="module")
def tiny_measured():
    cfg = MemoryConfig(model="tiny-llama", precision="fp32", batch=2, seq=32)
    return cfg, measure(cfg, device="cpu")


def test_measure_on_cpu_matches_trace_and_estimate(tiny_measured):
    cfg, measured = tiny_measured
    traced = trace(cfg)
    assert measured.source == "measure"
    assert (measured.weights, measured.grads, measured.optimizer) == (traced.weights, traced.grads,
                                                                     traced.optimizer)
    assert measured.activations == pytest.approx(traced.activations, rel=0.02)
    assert_agree(estimate(cfg), measured)


def test_trace_refuses_what_one_device_cannot_run():
    with pytest.raises(ConfigError, match="dp=2"):
        trace(MemoryConfig(model="tiny-llama", dp=2, zero=3, batch=1))
    with pytest.raises(ConfigError, match="adamw-8bit"):
        trace(MemoryConfig(model="tiny-llama", optimizer="adamw-8bit", batch=1))
    with pytest.raises(ConfigError, match="estimate"):
        trace(MemoryConfig(model="gpt3-175b", batch=1))


def test_cli_trace_prints_the_same_json_layout():
    out = CliRunner().invoke(command, ["trace", "--model", "tiny-llama", "--precision", "fp32", "--batch", "2",
                                       "--seq", "16", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output.strip().splitlines()[-1])
    assert list(data) == ["params", "trainable_params", "per_gpu_bytes", "cpu_bytes", "assumptions"]
    assert data["params"] == 106_816 and data["per_gpu_bytes"]["weights"] >= 4 * 106_816


def test_a_config_json_is_counted_on_meta_and_traced(tmp_path):
    from transformers import LlamaConfig

    from labkit.zoo import presets

    LlamaConfig(**presets.LLM_PRESETS["tiny-llama"]).save_pretrained(tmp_path)  # config.json only
    cfg = MemoryConfig(model=str(tmp_path / "config.json"), precision="fp32", batch=2, seq=16)
    est = estimate(cfg)
    assert est.params == 106_816
    assert_agree(est, trace(cfg))
