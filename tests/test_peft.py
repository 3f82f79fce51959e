"""LoRA / QLoRA (labkit.parallel.peft): counts, adapters on disk, merge, 4-bit bytes, and the strategies
through `labkit train` (single process, DDP and FSDP2 over 2 gloo ranks)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from labkit.errors import ConfigError
from labkit.memory.estimate import MemoryConfig, estimate
from labkit.zoo.models import build_llm, llm_config
from labkit.parallel import peft as lk_peft
from labkit.parallel import qlora as lk_qlora
from labkit.parallel.peft import LoraSettings

QV = LoraSettings(rank=8, alpha=16.0, targets="q,v")


def _batch(seed=0, batch=4, seq=16, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


def _train(model, steps=3, lr=1e-2):
    """A few real AdamW steps on the adapters so B != 0 (at init B = 0 and LoRA is the identity)."""
    from labkit.optim import build_optimizer

    opt = build_optimizer("adamw", [p for p in model.parameters() if p.requires_grad], lr)
    for step in range(steps):
        tokens = _batch(step)
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.fixture(scope="module")
def trained_lora():
    return _train(lk_peft.apply_lora(build_llm("tiny-llama", seed=0), cfg=QV))


# ---------------------------------------------------------------------------- settings and counts
def test_short_target_names_and_all_linear():
    assert lk_peft.parse_targets("q, v") == ("q_proj", "v_proj")
    assert lk_peft.parse_targets("q,k_proj,q") == ("q_proj", "k_proj")
    assert lk_peft.parse_targets("all") == lk_peft.ALL_LINEAR


def test_unknown_target_names_the_valid_layers():
    with pytest.raises(ConfigError, match="'attn'.*q_proj"):
        lk_peft.apply_lora(build_llm("tiny-llama"), cfg=LoraSettings(targets="q,attn"))


@pytest.mark.parametrize("bad", [dict(rank=0), dict(alpha=0.0), dict(dropout=1.0), dict(targets=" , ")])
def test_bad_lora_settings_are_config_errors(bad):
    with pytest.raises(ConfigError):
        LoraSettings(**bad)


@pytest.mark.parametrize("targets", ["q,v", "all-linear"])
def test_llama2_7b_trainable_params_match_peft_and_the_estimator(targets):
    # Built on the meta device: peft counts 6.7 B parameters without allocating a byte.
    with torch.device("meta"):
        model = lk_peft.apply_lora(build_llm("llama2-7b"), cfg=dataclasses.replace(QV, targets=targets))
    trainable, total = model.get_nb_trainable_parameters()
    est = estimate(MemoryConfig(model="llama2-7b", lora_rank=8, lora_targets=tuple(targets.split(","))))
    assert lk_peft.trainable_counts(model) == (trainable, total)
    assert est.trainable_params == trainable
    assert est.params == total
    if targets == "q,v":
        assert trainable == 4_194_304  # 32 layers x 2 linears x 8 x (4096 + 4096)


def test_lora_freezes_the_base_and_starts_as_the_identity():
    base = build_llm("tiny-llama", seed=0)
    tokens = _batch()[:, :-1]
    with torch.no_grad():
        expected = base(input_ids=tokens).logits
    model = lk_peft.apply_lora(base, cfg=QV)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, expected)  # B = 0 at init (Hu et al. Sec. 4.1)


# ---------------------------------------------------------------------------- adapters and merge
def test_adapter_save_load_round_trip_gives_identical_outputs(trained_lora, tmp_path):
    size = lk_peft.save_adapter(trained_lora, tmp_path / "adapter")
    assert size == lk_peft.adapter_bytes(tmp_path / "adapter")
    # fp32 A and B: 4 bytes x 3584 params, plus the safetensors header and adapter_config.json
    assert 4 * 3584 < size < 4 * 3584 + 16_384
    reloaded = lk_peft.load_adapter(build_llm("tiny-llama", seed=0), tmp_path / "adapter").eval()
    tokens = _batch(7)[:, :-1]
    trained_lora.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=tokens).logits, trained_lora(input_ids=tokens).logits)
    trained_lora.train()


def test_loading_a_folder_without_an_adapter_says_how_to_fix(tmp_path):
    with pytest.raises(ConfigError, match="save_adapter"):
        lk_peft.load_adapter(build_llm("tiny-llama"), tmp_path)


def test_merge_and_unload_matches_the_unmerged_model(trained_lora):
    tokens = _batch(3)[:, :-1]
    assert lk_peft.merge_error(trained_lora, tokens) < 1e-5
    merged = lk_peft.merge(trained_lora)
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert sum(p.numel() for p in merged.parameters()) == sum(p.numel() for p in build_llm("tiny-llama").parameters())
    assert any(p.requires_grad for p in trained_lora.parameters())  # the original is left as it was


# ---------------------------------------------------------------------------- QLoRA: 4-bit weights
def _save_llama_shaped(path):
    """A small Llama with Llama-2-7B's proportions: embedding + head ~4 % of the weights (7B: 3.9 %)."""
    from transformers import LlamaForCausalLM

    config = llm_config("tiny-llama")
    for key, value in dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=4).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qlora_tiny(tmp_path_factory):
    from labkit.zoo.models import save_llm

    path = save_llm("tiny-llama", tmp_path_factory.mktemp("tiny") / "ckpt")
    return lk_qlora.apply_qlora(lk_qlora.load_4bit(path), cfg=QV)


def test_qlora_loads_nf4_with_double_quantization_through_from_pretrained(qlora_tiny):
    import bitsandbytes as bnb

    quantized = [m for m in qlora_tiny.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 2 * 7  # every block linear; lm_head stays 16-bit
    state = quantized[0].weight.quant_state
    assert state.quant_type == "nf4" and state.nested and state.blocksize == 64
    assert qlora_tiny.get_input_embeddings().weight.dtype == torch.bfloat16


def test_qlora_weight_bytes_count_the_packed_storage_and_every_constant(qlora_tiny):
    wb = lk_qlora.weight_bytes(qlora_tiny)
    sizes = [64 * 64, 64 * 32, 64 * 32, 64 * 64, 64 * 128, 64 * 128, 128 * 64] * 2  # q,k,v,o,gate,up,down
    assert wb["packed_4bit"] == sum(sizes) // 2  # two 4-bit weights per byte
    # per linear: uint8 absmax per 64-block, NF4 code (16 fp32), offset, and the nested state's fp32
    # absmax per 256 blocks plus its 256-entry fp32 code (QLoRA Sec. 3, double quantization)
    constants = sum(n // 64 + 16 * 4 + 4 + 4 * -(-n // (64 * 256)) + 256 * 4 for n in sizes)
    assert wb["quant_state"] == constants
    assert wb["bf16_equivalent"] == 2 * 106_816  # tiny-llama's parameters in bf16
    # embedding + head (bf16) + norms and adapters (fp32)
    assert wb["other"] == 2 * 2 * 256 * 64 + 4 * (5 * 64 + 3584)


def test_qlora_resident_weights_at_most_035x_bf16_for_a_llama_shaped_model(tmp_path):
    model = lk_qlora.apply_qlora(lk_qlora.load_4bit(_save_llama_shaped(tmp_path / "m")), cfg=QV)
    wb = lk_qlora.weight_bytes(model)
    assert wb["total"] <= 0.35 * wb["bf16_equivalent"]
    est = estimate(MemoryConfig(model=str(tmp_path / "m"), lora_rank=8, quant="nf4-dq"))
    # the estimator counts norms and adapters at 2 B; we keep them in fp32 (prepare_model_for_kbit_training)
    assert est.weights == pytest.approx(wb["total"], rel=0.05)


def test_apply_qlora_refuses_a_model_that_is_not_4bit():
    with pytest.raises(ConfigError, match="load_4bit"):
        lk_qlora.apply_qlora(build_llm("tiny-llama"), cfg=QV)


# ---------------------------------------------------------------------------- through `labkit train`
RUN = dict(profile="smoke", progress=False)


def _adapter_tensors(record):
    from safetensors.torch import load_file
    return load_file(f"{record.peft.adapter_path}/adapter_model.safetensors")


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """One LoRA run per way of running it, 4 steps each: in-process, DDP and FSDP2 over 2 gloo ranks (both in
    one torchrun job, `run_many`: its ranks import torch and peft once, not once per run)."""
    from labkit.train.api import run
    from labkit.train.many import run_many

    out = str(tmp_path_factory.mktemp("lora"))
    common = dict(RUN, steps=4, out=out, eval_batches=1)
    ddp, fsdp = run_many(["lora", ("lora", {"lora_parallel": "fsdp"})], "tiny-llama", nproc=2, stream=False, **common)
    return {"single": run("lora", "tiny-llama", **common), "ddp": ddp, "fsdp": fsdp}


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_lora_record_reports_trainable_params_fraction_and_adapter_size(lora_runs):
    rec = lora_runs["single"]
    assert rec.trainable_params == 3584 == rec.peft.total_params - 106_816  # r (d_in + d_out) x q,v x 2
    assert rec.peft.trainable_fraction == pytest.approx(3584 / (106_816 + 3584))
    assert rec.peft.adapter_bytes == lk_peft.adapter_bytes(rec.peft.adapter_path)
    assert rec.grad_bytes[0] == 4 * 3584  # gradients only for the adapters
    assert rec.optimizer_bytes[0] >= 2 * 4 * 3584  # AdamW's two fp32 moments (+ step counters)


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_lora_data_parallel_matches_single_process(lora_runs, mode):
    single, rec = lora_runs["single"], lora_runs[mode]
    assert rec.world_size == 2 and rec.peft.lora_parallel == mode
    assert rec.losses == pytest.approx(single.losses, rel=1e-5)
    ref = _adapter_tensors(single)
    got = _adapter_tensors(rec)
    assert ref.keys() == got.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=1e-6)
    if mode == "fsdp":  # FSDP2 shards the frozen base, the adapters and their grads / optimizer state
        assert rec.param_bytes[0] == pytest.approx(single.param_bytes[0] / 2, rel=0.02)
        assert rec.grad_bytes[0] == single.grad_bytes[0] // 2


def test_lora_checkpoint_holds_only_the_adapters_and_resumes_exactly(tmp_path):
    from labkit.train.api import run

    common = dict(RUN, eval_batches=0)
    straight = run("lora", "tiny-llama", steps=5, out=str(tmp_path / "a"), **common)
    run("lora", "tiny-llama", steps=4, checkpoint_every=3, out=str(tmp_path / "b"), **common)
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(tmp_path / "b" / "checkpoints" / "step_3")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert len(model_keys) == 8 and all("lora_" in k for k in model_keys)  # A, B x q, v x 2 layers
    resumed = run("lora", "tiny-llama", steps=5, resume=True, out=str(tmp_path / "b"), **common)
    assert resumed.train.resumed_from == 3
    assert resumed.losses == straight.losses


def test_qlora_trains_from_a_saved_checkpoint_and_reports_its_quantization(tmp_path):
    from labkit.train.api import run

    rec = run("qlora", "tiny-llama", steps=20, out=str(tmp_path), eval_batches=1, **RUN)
    assert sum(rec.losses[-5:]) / 5 < sum(rec.losses[:5]) / 5 - 0.01  # the loss falls over 20 smoke steps
    x = rec.peft
    assert (tmp_path / "base" / "tiny-llama-seed0" / "config.json").is_file()  # loaded by from_pretrained
    assert x.quant_type == "nf4" and x.double_quant and x.compute_dtype == "bfloat16"
    assert rec.optim.name == "paged-adamw-8bit" and rec.optim.paged is False  # CPU: no paging
    # resident parameter bytes = packed 4-bit + quantization constants + 16/32-bit rest
    assert rec.param_bytes[0] == x.weight_bytes["total"]
    assert x.weight_bytes["packed_4bit"] == 73_728 // 2
    assert rec.trainable_params == 3584
    reloaded = lk_peft.load_adapter(lk_qlora.load_4bit(tmp_path / "base" / "tiny-llama-seed0"), x.adapter_path)
    assert any(torch.count_nonzero(p) for n, p in reloaded.named_parameters() if "lora_B" in n)


def test_lora_rejects_image_models():
    from labkit.train.api import make_config

    with pytest.raises(ConfigError, match="tiny-llama"):
        make_config("lora", "tiny-resnet")


def test_fsdp_refuses_bitsandbytes_optimizers_and_says_what_works():
    from labkit.train.api import make_config

    with pytest.raises(ConfigError, match="--optimizer adamw"):
        make_config("qlora", "tiny-llama", nproc=2, lora_parallel="fsdp")  # default: paged-adamw-8bit
    with pytest.raises(ConfigError, match="DTensor"):
        make_config("lora", "tiny-llama", nproc=2, lora_parallel="fsdp", optimizer="adamw-8bit")
    make_config("qlora", "tiny-llama", nproc=2, lora_parallel="fsdp", optimizer="adamw")
