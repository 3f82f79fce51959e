"""fsdp-qlora: FSDP2 over a 4-bit NF4 base with LoRA adapters on 2 gloo ranks -- really sharded, trains like
single-process QLoRA; what cannot run is refused with the reason; low-bit optimizer state measured."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from labkit.errors import ConfigError
from labkit.parallel import stack, studies
from labkit.train import run
from labkit.train.api import make_config
from labkit.train.many import run_many

STEPS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("stack"))
    sharded, offload = run_many(["fsdp-qlora", "fsdp-qlora-offload"], "tiny-llama", nproc=2, out=out,
                                steps=STEPS, progress=False, stream=False)
    # The reference: the same QLoRA model and optimizer in one process.
    single = run("qlora", "tiny-llama", steps=STEPS, out=out, optimizer="adamw", progress=False)
    return sharded, offload, single


@pytest.mark.slow
def test_fsdp_qlora_on_two_ranks_trains_like_single_process_qlora(runs):
    sharded, _, single = runs
    assert sharded.world_size == 2 and sharded.steps == STEPS and np.isfinite(sharded.losses).all()
    # bf16 compute on both sides; FSDP gathers the adapters in bf16 (MixedPrecisionPolicy).
    np.testing.assert_allclose(sharded.losses, single.losses, rtol=2e-3)
    assert sharded.trainable_params == single.trainable_params
    assert sharded.peft.trainable_fraction == pytest.approx(single.peft.trainable_fraction)


@pytest.mark.slow
def test_the_nf4_weights_are_really_sharded(runs):
    sharded, _, single = runs
    x = sharded.peft
    assert x.quant_type == "nf4" and sharded.sharding.mesh_shape == [2] and x.quant_storage == "uint8"
    assert 2 * x.packed_4bit_rank_bytes == x.packed_4bit_full_bytes
    assert x.packed_4bit_full_bytes == single.peft.weight_bytes["packed_4bit"]
    # Each rank holds half of everything that is sharded; the QuantState constants stay replicated.
    assert x.quant_state_bytes_replicated == single.peft.weight_bytes["quant_state"]
    for rank in range(2):
        assert sharded.param_bytes[rank] < single.param_bytes[0]
        assert sharded.optimizer_bytes[rank] == pytest.approx(single.optimizer_bytes[0] / 2, rel=0.05)


@pytest.mark.slow
def test_the_offload_variant_computes_the_same_and_reports_its_host_bytes(runs):
    sharded, offload, _ = runs
    assert offload.losses == sharded.losses
    assert offload.memory.offload and not offload.memory.offload_physical  # CPU: host is the device
    assert all(b > 0 for b in offload.cpu_offload_bytes) and sharded.cpu_offload_bytes == [0, 0]


def test_bitsandbytes_optimizers_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="no DTensor sharding rule") as info:
        make_config("fsdp-qlora", "tiny-llama", nproc=2, optimizer="adamw-8bit")
    assert "--optimizer adamw" in str(info.value)


def test_a_float_4bit_storage_that_fsdp_would_cast_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from labkit.zoo.models import save_llm
    from labkit.parallel.qlora import load_4bit

    path = save_llm("tiny-llama", tmp_path / "base")
    stack.check_storage(load_4bit(path), torch.bfloat16)  # uint8 storage: FSDP never casts integers
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=torch.bfloat16,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, device_map="cpu")
    stack.check_storage(model, torch.bfloat16)  # same dtype: not cast
    with pytest.raises(ConfigError, match="corrupt the packed NF4 bytes"):
        stack.check_storage(model, torch.float16)


@pytest.mark.slow  # ~100 CPU s: torchao's low-bit optimizers compile their kernels; not in `make test-fast`
def test_low_bit_optimizer_state_is_measured():
    rows = {r["optimizer"]: r for r in studies.optimizer_memory("tiny-llama")}
    adamw = rows["torch AdamW (fp32 states)"]["bytes_per_param"]
    assert 8.0 <= adamw < 8.1  # two fp32 moments (+ a step counter per tensor)
    for name in ("bitsandbytes AdamW8bit", "bitsandbytes PagedAdamW8bit"):
        assert rows[name]["available"] and rows[name]["bytes_per_param"] < 0.35 * adamw
    for name in ("torchao AdamW8bit", "torchao AdamW4bit"):
        row = rows[name]
        assert row["available"], row["note"]  # torchao is a course dependency (pyproject, environment.yml)
        assert row["bytes_per_param"] < 0.35 * adamw
