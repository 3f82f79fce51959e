"""labkit.memory.estimate: the formulas, their conventions, validation and the CLI (no torch needed)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from click.testing import CliRunner

from labkit.cli.memory import command, config_from_options, parse_count
from labkit.errors import ConfigError
from labkit.memory import activations as act
from labkit.memory.advice import single_changes, what_fits
from labkit.memory.estimate import MemoryConfig, check_topology, estimate
from labkit.memory.params import model_spec
from labkit.memory.report import GPU_CAPACITIES, format_table

GB = 1e9


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure1_per_device(stage, expected_gb):
    # ZeRO paper Fig. 1: Psi = 7.5B, K = 12, N_d = 64, mixed-precision Adam.
    est = estimate(MemoryConfig(params=7_500_000_000, precision="mixed-fp16", optimizer="adamw",
                                zero=stage, dp=64))
    assert round(est.model_states / GB, 1) == expected_gb
    assert est.activations == 0 and est.total == est.model_states


@pytest.mark.parametrize("name, count", [
    ("resnet50", 25_557_032), ("tiny-resnet", 8_036_426), ("tiny-llama", 106_816),
    ("tinyllama-1.1b", 1_100_048_384), ("llama3.2-1b", 1_235_814_400), ("llama2-7b", 6_738_415_616),
    ("llama3-8b", 8_030_261_248), ("gpt3-175b", 174_604_259_328)])
def test_exact_parameter_counts(name, count):
    assert model_spec(name).params == count
    assert estimate(MemoryConfig(model=name)).params == count


def test_fp32_adamw_is_what_torch_allocates_and_mixed_follows_zero():
    n = 1000
    fp32 = estimate(MemoryConfig(params=n, precision="fp32"))
    assert (fp32.weights, fp32.grads, fp32.optimizer) == (4 * n, 4 * n, 8 * n)  # param, grad, exp_avg(_sq)
    mixed = estimate(MemoryConfig(params=n, precision="mixed-bf16"))
    assert (mixed.weights, mixed.grads, mixed.optimizer) == (2 * n, 2 * n, 12 * n)
    pure = estimate(MemoryConfig(params=n, precision="bf16"))
    assert pure.optimizer == 4 * n  # torch keeps the moments in the parameter dtype
    assert estimate(MemoryConfig(params=n, precision="fp32", optimizer="sgd")).optimizer == 0
    assert estimate(MemoryConfig(params=n, precision="fp32", optimizer="sgd-momentum")).optimizer == 4 * n
    eight = estimate(MemoryConfig(params=2560, precision="bf16", optimizer="adamw-8bit"))
    assert eight.optimizer == 2 * 2560 + 2 * 4 * 10  # two 1-byte states + fp32 absmax per 256


def test_zero_stages_shard_over_dp_for_the_sharding_labs():
    n = model_spec("tiny-llama").params
    base = dict(model="tiny-llama", precision="fp32")
    z0 = estimate(MemoryConfig(**base, zero=0, dp=2))
    z3 = estimate(MemoryConfig(**base, zero=3, dp=2))
    assert z0.grads == 4 * n and z0.optimizer == 8 * n
    assert z3.grads == math.ceil(4 * n / 2) and z3.optimizer == math.ceil(8 * n / 2)
    assert z3.weights == math.ceil(z0.weights / 2)
    z2 = estimate(MemoryConfig(**base, zero=2, dp=2))
    assert z2.weights == z0.weights and z2.grads == z3.grads


def test_fsdp_strategies_map_to_zero_stages_and_hybrid_shards_within_a_node():
    kw = dict(params=8_000_000_000, dp=64)
    assert MemoryConfig.for_fsdp("full_shard", **kw).zero == 3
    assert MemoryConfig.for_fsdp("shard_grad_op", **kw).zero == 2
    assert MemoryConfig.for_fsdp("no_shard", **kw).zero == 0
    hybrid = estimate(MemoryConfig.for_fsdp("hybrid_shard", node_size=8, **kw))
    assert hybrid.model_states == estimate(MemoryConfig(params=8_000_000_000, zero=3, dp=8)).model_states
    with pytest.raises(ConfigError, match="node_size"):
        MemoryConfig.for_fsdp("hybrid_shard", **kw)


def test_lora_trainable_params_match_peft_counts():
    est = estimate(MemoryConfig(model="llama2-7b", lora_rank=8, lora_targets=("q", "v")))
    assert est.trainable_params == 4_194_304
    assert est.params == 6_738_415_616 + 4_194_304  # peft's "all params" includes the adapters
    assert est.grads == 2 * 4_194_304 and est.optimizer == 12 * 4_194_304
    assert est.weights == 2 * (6_738_415_616 + 4_194_304) + 2 * 128  # frozen base + adapters + rope buffers


def test_qlora_nf4_double_quant_is_4127_bits_and_embeddings_stay_16_bit():
    spec = model_spec("llama2-7b")
    est = estimate(MemoryConfig(model="llama2-7b", lora_rank=8, quant="nf4-dq", precision="bf16"))
    quantized = sum(lin.fan_in * lin.fan_out * lin.count for lin in spec.linears)
    sixteen = (spec.params - quantized) * 2
    base = est.weights - 2 * est.trainable_params - 2 * spec.buffers
    bits = (base - sixteen) * 8 / quantized
    assert bits == pytest.approx(4 + 8 / 64 + 32 / (64 * 256), abs=1e-4)
    nf4 = estimate(MemoryConfig(model="llama2-7b", lora_rank=8, quant="nf4", precision="bf16"))
    int8 = estimate(MemoryConfig(model="llama2-7b", lora_rank=8, quant="int8", precision="bf16"))
    assert est.weights < nf4.weights < int8.weights < estimate(MemoryConfig(model="llama2-7b")).weights


def test_topology_product_is_checked_and_named():
    with pytest.raises(ConfigError, match=r"tp\(8\) \* pp\(8\) \* dp\(8\) = 512 != gpus\(64\)"):
        check_topology(dp=8, tp=8, pp=8, gpus=64)
    check_topology(dp=1, tp=8, pp=8, gpus=64)
    with pytest.raises(ConfigError, match="512"):
        MemoryConfig(model="gpt3-175b", dp=8, tp=8, pp=8, gpus=64)


def test_gpt3_on_64_gpus_with_tp8_pp8_shards_model_states():
    est = estimate(MemoryConfig(model="gpt3-175b", tp=8, pp=8, gpus=64))
    assert est.model_states == pytest.approx(16 * 174.6e9 / 64, rel=0.05)
    assert est.model_states < GPU_CAPACITIES["A100 80GB"] < estimate(MemoryConfig(model="gpt3-175b")).total


@pytest.mark.parametrize("field, value, valid", [
    ("precision", "fp8", "mixed-bf16"), ("optimizer", "lion", "adamw-8bit"), ("offload", "disk", "optimizer"),
    ("checkpointing", "some", "selective"), ("quant", "fp4", "nf4-dq"), ("zero", 4, "3")])
def test_bad_values_are_named_with_the_valid_ones(field, value, valid):
    with pytest.raises(ConfigError) as info:
        MemoryConfig(model="tiny-llama", **{field: value})
    assert repr(value) in str(info.value) and valid in str(info.value)


def test_invalid_combinations_say_how_to_fix():
    with pytest.raises(ConfigError, match="--zero"):
        MemoryConfig(params=10**9, offload="optimizer")
    with pytest.raises(ConfigError, match="zero=3"):
        MemoryConfig(params=10**9, zero=2, offload="optimizer+params")
    with pytest.raises(ConfigError, match="LoRA rank"):
        MemoryConfig(model="llama2-7b", quant="nf4")
    with pytest.raises(ConfigError, match="exactly one"):
        MemoryConfig(model="llama2-7b", params=7)
    with pytest.raises(ConfigError, match="grad_accum"):
        MemoryConfig(model="llama2-7b", batch=6, grad_accum=4)
    with pytest.raises(ConfigError, match="unknown LoRA target"):
        estimate(MemoryConfig(model="llama2-7b", lora_rank=8, lora_targets=("qkv",)))
    with pytest.raises(ConfigError, match="architecture"):
        estimate(MemoryConfig(params=10**9, batch=4))


def test_offload_moves_states_to_host():
    cfg = MemoryConfig(model="llama2-7b", zero=2)
    plain = estimate(cfg)
    off = estimate(cfg.replace(offload="optimizer"))
    assert off.optimizer == 0 and off.weights == plain.weights
    assert off.cpu_bytes == plain.optimizer + 4 * plain.trainable_params  # + fp32 grads for CPU Adam
    inf = estimate(cfg.replace(zero=3, offload="optimizer+params"))
    assert inf.weights == 2 * model_spec("llama2-7b").largest_layer < plain.weights / 10
    assert inf.cpu_bytes > off.cpu_bytes


def test_activation_levers_move_in_the_right_direction():
    base = MemoryConfig(model="llama2-7b", batch=8, seq=2048, flash_attention=False)
    a = {c: estimate(base.replace(checkpointing=c)).activations for c in ("none", "selective", "full")}
    assert a["full"] < a["selective"] < a["none"]
    assert estimate(base.replace(flash_attention=True)).activations < a["none"]
    assert estimate(base.replace(grad_accum=4)).activations < a["none"] / 3
    tp = base.replace(tp=8, gpus=8)
    assert estimate(tp.replace(sequence_parallel=True)).activations < estimate(tp).activations
    assert estimate(MemoryConfig(model="llama2-7b", batch=None)).activations == 0


def test_gpt_layer_matches_korthikanti_table2():
    arch = model_spec("gpt3-175b").arch
    s, b, h, a = 2048, 1, arch["hidden"], arch["heads"]
    step = act.Step(micro_batch=b, seq=s, act_bytes=2, flash=False)
    assert act.gpt_layer(arch, step).stored(step) == s * b * h * (34 + 5 * a * s / h)
    tp = act.Step(micro_batch=b, seq=s, act_bytes=2, flash=False, tp=8)
    assert act.gpt_layer(arch, tp).stored(tp) == pytest.approx(s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    sp = act.Step(micro_batch=b, seq=s, act_bytes=2, flash=False, tp=8, sp=True)
    assert act.gpt_layer(arch, sp).stored(sp) == pytest.approx(s * b * h / 8 * (34 + 5 * a * s / h))


def test_pipeline_first_stage_holds_pp_micro_batches_under_1f1b():
    cfg = MemoryConfig(model="llama2-7b", batch=8, seq=1024, grad_accum=8, checkpointing="full")
    one = estimate(cfg).activations
    piped = estimate(cfg.replace(pp=4)).activations
    # L/pp layers x pp micro-batches in flight ~ the same inputs as L layers x 1 micro-batch
    assert 0.5 * one < piped < 1.5 * one


def test_single_changes_that_fit_really_fit():
    cfg = MemoryConfig(model="llama2-7b", batch=1, seq=512)
    cap = GPU_CAPACITIES["RTX 4090 24GB"]
    res = what_fits(cfg, cap)
    assert not res["fits"] and res["total"] > 100e9
    assert any("LoRA" in f for f in res["fixes"]) and any("QLoRA" in f for f in res["fixes"])
    fits = {f.label: f.estimate.fits(cap) for f in single_changes(cfg)}
    assert set(res["fixes"]) == {k for k, ok in fits.items() if ok}
    assert not fits["8-bit AdamW (bitsandbytes)"]  # 6.7B x 10 B still > 24 GB


def test_json_layout_is_exact():
    data = json.loads(estimate(MemoryConfig(model="tiny-llama", batch=2, seq=32)).to_json())
    assert list(data) == ["params", "trainable_params", "per_gpu_bytes", "cpu_bytes", "assumptions"]
    assert list(data["per_gpu_bytes"]) == ["weights", "grads", "optimizer", "activations", "total"]
    assert all(isinstance(v, int) for v in data["per_gpu_bytes"].values())
    assert data["per_gpu_bytes"]["total"] == sum(v for k, v in data["per_gpu_bytes"].items() if k != "total")
    assert all(isinstance(a, str) for a in data["assumptions"])


def test_cli_estimate_json_params_only_and_defaults():
    out = CliRunner().invoke(command, ["estimate", "--params", "7e9", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["params"] == 7_000_000_000 and data["per_gpu_bytes"]["activations"] == 0
    assert data["per_gpu_bytes"]["total"] == 16 * 7_000_000_000  # mixed-bf16 + adamw, zero 0
    assert data["cpu_bytes"] == 0


def test_cli_gpus_mismatch_exits_2_naming_the_product():
    out = CliRunner().invoke(command, ["estimate", "--model", "gpt3-175b", "--tp", "8", "--pp", "8",
                                       "--dp", "8", "--gpus", "64"])
    assert out.exit_code == 2
    assert "512" in out.output and "64" in out.output


def test_cli_human_table_spells_out_units():
    out = CliRunner().invoke(command, ["estimate", "--model", "llama2-7b", "--lora-rank", "8",
                                       "--lora-targets", "q,v", "--quant", "nf4-dq", "--batch", "1"])
    assert out.exit_code == 0, out.output
    assert "GB (10^9 B)" in out.output and "GiB (2^30 B)" in out.output and "4,194,304" in out.output


def test_cli_core_is_callable_in_process():
    cfg = config_from_options(model="llama2-7b", fsdp="hybrid_shard", node_size=8, dp=16, lora_targets="q,v")
    assert (cfg.zero, cfg.zero_group) == (3, 8)
    assert parse_count("175B") == 175 * 10**9 and parse_count("7.5e9") == 7_500_000_000
    with pytest.raises(ConfigError, match="not both"):
        config_from_options(model="llama2-7b", fsdp="full_shard", zero=2)
    assert "fits on" in format_table(estimate(cfg))


def test_estimate_module_does_not_import_torch():
    code = ("import sys, labkit.cli.memory; import labkit.memory.estimate as e; "
            "e.estimate(e.MemoryConfig(model='llama2-7b', batch=1)); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- issue 18: LoRA slices, gathered layer
def test_lora_q_v_on_gpt3_fused_qkv_is_the_lora_papers_18_9m():
    # Hu et al. 2022, Sec. 7.1: r=4 on Wq and Wv of all 96 layers of GPT-3 175B, "18M" budget (18.9M)
    est = estimate(MemoryConfig(model="gpt3-175b", lora_rank=4, lora_targets=("q", "v")))
    assert est.trainable_params == 96 * 2 * 4 * (12288 + 12288) == 18_874_368
    fused = estimate(MemoryConfig(model="gpt3-175b", lora_rank=4, lora_targets=("qkv",)))
    assert fused.trainable_params == 96 * 4 * (12288 + 3 * 12288)
    with pytest.raises(ConfigError, match="overlap"):
        estimate(MemoryConfig(model="gpt3-175b", lora_rank=4, lora_targets=("qkv", "q")))


def test_lora_q_v_cli_on_gpt3():
    from click.testing import CliRunner

    from labkit.cli.memory import command

    out = CliRunner().invoke(command, ["estimate", "--model", "gpt3-175b", "--lora-rank", "4",
                                       "--lora-targets", "q,v", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["trainable_params"] == 18_874_368


def test_offloaded_params_with_a_bare_count_keep_one_assumed_layer_on_the_gpu():
    from labkit.memory.estimate import ASSUMED_LAYERS

    n = 2_851_000_000
    est = estimate(MemoryConfig(params=n, zero=3, dp=8, offload="optimizer+params"))
    layer = -(-n // ASSUMED_LAYERS)
    assert est.weights == layer * 2 and est.grads == layer * 2  # not the whole model (11.4 GB before)
    assert est.total < n * 2 / 8
    assert any("ASSUMED" in a and "--largest-layer" in a for a in est.assumptions)
    given = estimate(MemoryConfig(params=n, zero=3, dp=8, offload="optimizer+params", largest_layer=10**8))
    assert given.weights == 2 * 10**8 and any("(given)" in a for a in given.assumptions)


def test_largest_layer_cli_option_is_parsed_and_printed():
    from click.testing import CliRunner

    from labkit.cli.memory import command

    args = ["estimate", "--params", "2.851e9", "--zero", "3", "--dp", "8", "--offload", "optimizer+params"]
    out = CliRunner().invoke(command, args + ["--largest-layer", "1e8"])
    assert out.exit_code == 0, out.output
    assert "100,000,000 params (given)" in out.output
    bad = CliRunner().invoke(command, args + ["--largest-layer", "big"])
    assert bad.exit_code == 2 and "--largest-layer 'big'" in bad.output


def test_gpu_capacities_have_one_definition_used_everywhere(tmp_path):
    """Issue 18: the RTX 4090 was 24 GiB in one place and 24e9 B in others; the V100 was missing."""
    import re
    from pathlib import Path

    from labkit.profiling import oom
    from labkit.course.grading.nb_checks import lab05_zero, lab06_peft
    from labkit.course.grading.tamper import device_spec

    assert GPU_CAPACITIES["RTX 4090 24GB"] == 24_564 * 2**20 and "V100 32GB" in GPU_CAPACITIES
    assert lab05_zero.GPU_BYTES == lab06_peft.GPU_BYTES == GPU_CAPACITIES["RTX 4090 24GB"]
    assert {s[1] for s in oom.scenarios(tmp_path).values()} == {GPU_CAPACITIES["RTX 4090 24GB"]}
    assert device_spec("NVIDIA GeForce RTX 4090")[1] == GPU_CAPACITIES["RTX 4090 24GB"]
    root = Path(__file__).resolve().parents[1]
    stray = [str(p.relative_to(root)) for p in [*root.glob("labkit/**/*.py"), *root.glob("notebooks/*.ipynb")]
             if re.search(r"\b24e9\b|\b24 \* GB\b|\b24 \* 2\*\*30\b", p.read_text(encoding="utf-8"))]
    assert stray == [], f"a second definition of the 24 GB GPU in {stray}: use GPU_CAPACITIES"


def test_three_memory_conventions_match_the_libraries_that_state_them():
    from accelerate.commands.estimate import estimate_training_usage
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from labkit.memory.conventions import conventions, format_conventions

    spec = model_spec("llama2-7b")
    p, layer = spec.params, spec.largest_layer
    rows = {r.name: r.bytes for r in conventions(p, layer)}
    assert rows["accelerate estimate-memory, float32"] == max(estimate_training_usage(4 * p, "float32").values())
    assert rows["accelerate estimate-memory, float16"] == max(estimate_training_usage(4 * p, "float16").values())
    assert rows["DeepSpeed ZeRO-2 estimator, 1 GPU"] == estimate_zero2_model_states_mem_needs(p, 1, 1, cpu_offload=False)[1]
    assert rows["DeepSpeed ZeRO-3 estimator, 1 GPU"] == estimate_zero3_model_states_mem_needs(
        p, layer, 1, 1, cpu_offload=False)[1]
    assert rows["ZeRO paper (2 + 2 + 12)"] == estimate(MemoryConfig(model="llama2-7b")).total - 2 * spec.buffers
    assert "20.0" in format_conventions(conventions(p, layer), p)


def test_state_layouts_are_what_each_stack_allocates():
    import torch

    from labkit.memory.conventions import format_layouts, state_layouts

    rows = {r.name: r for r in state_layouts(dp=8)}
    zero_paper = rows["DeepSpeed / Megatron bf16 (ZeRO paper)"]
    est = estimate(MemoryConfig(params=1_000_000, precision="mixed-bf16"))
    assert (zero_paper.weights, zero_paper.grads, zero_paper.optimizer) == (2, 2, 12)
    assert est.model_states == zero_paper.total * 1_000_000
    # torch.autocast trains fp32 parameters: count what one AdamW step really allocates per parameter
    layer = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(layer.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(4, 64)).float().sum().backward()
    opt.step()
    n = sum(p.numel() for p in layer.parameters())
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
    autocast = rows["torch.autocast (labs 02, 03)"]
    assert autocast.weights * n == sum(p.numel() * p.element_size() for p in layer.parameters())
    assert autocast.grads * n == sum(p.grad.numel() * p.grad.element_size() for p in layer.parameters())
    assert autocast.optimizer * n == state and autocast.total == 16
    assert rows["Megatron bf16, fp32 main grads"].total == 18
    assert rows["  + distributed optimizer, d=8"].total == 6 + 12 / 8
    assert "18" in format_layouts(state_layouts())
    with pytest.raises(ConfigError, match="dp=0"):
        state_layouts(dp=0)


def test_kbit_preparation_and_offload_host_bytes_as_the_lessons_quote_them():
    from labkit.memory.conventions import kbit_upcast_bytes, offload_host_bytes

    # PEFT casts the embedding, LM head and norms to fp32: +2 B each (slides/06, docs/peft.md)
    spec = model_spec("llama2-7b")
    quantized = sum(x.fan_in * x.fan_out * x.count for x in spec.linears)
    assert kbit_upcast_bytes("llama2-7b") == 2 * (spec.params - quantized)
    assert round(kbit_upcast_bytes("llama2-7b") / 1e9, 1) == 0.5
    assert round(kbit_upcast_bytes("llama3-8b") / 1e9, 1) == 2.1
    # notebook 05: ZeRO-2 + optimizer offload of Llama-2-7B on 2 ranks, 50 GiB per rank, ~100 GiB per node
    cfg = MemoryConfig(model="llama2-7b", precision="mixed-bf16", zero=2, offload="optimizer", dp=2)
    rank, node = offload_host_bytes(cfg, ranks_per_node=2)
    assert rank == estimate(cfg).cpu_bytes == (12 + 4) * spec.params // 2 and node == 2 * rank
    assert (round(rank / 2**30), round(node / 2**30)) == (50, 100)
