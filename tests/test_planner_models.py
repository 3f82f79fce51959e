"""`labkit plan --model` takes what `labkit memory estimate` takes (issue 27): presets, Hugging Face ids in the
local cache, folders and config.json files of the llama, mistral, qwen2, mixtral, gpt2, gpt_neox, bloom, opt and
falcon families -- tiny configs written here, no Hub. Plus the planner's new switches."""
from __future__ import annotations

import json

import pytest

from labkit import cli
from labkit.errors import ConfigError
from labkit.memory.params import config_spec, meta_param_count
from labkit.parallel import planner

TINY = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=256),
    "mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=300, max_position_embeddings=256),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, tie_word_embeddings=False),
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
                    num_local_experts=4, num_experts_per_tok=2),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=4, n_head=4, vocab_size=300, n_positions=256),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=4, vocab_size=300, max_position_embeddings=256),
    "bloom": dict(model_type="bloom", hidden_size=64, n_layer=4, n_head=4, vocab_size=300),
    "opt": dict(model_type="opt", hidden_size=64, ffn_dim=256, num_hidden_layers=4, num_attention_heads=4,
                vocab_size=300, max_position_embeddings=256, word_embed_proj_dim=64),
    "falcon": dict(model_type="falcon", hidden_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=300,
                   multi_query=True, parallel_attn=True, bias=False),
    "falcon-gqa": dict(model_type="falcon", hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_kv_heads=2,
                       new_decoder_architecture=True, vocab_size=300, bias=False),
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    for name, cfg in TINY.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
    return root


@pytest.mark.parametrize("family", list(TINY))
def test_family_counts_are_exact_and_the_planner_accepts_them(configs, family):
    spec = config_spec(configs / family)
    assert spec.params == meta_param_count(configs / family / "config.json")  # the model HF would build
    assert spec.kind in ("llm", "gpt") and spec.num_blocks == 4 and spec.linears
    req = planner.PlanRequest(model=str(configs / family / "config.json"), gpus=4, gpus_per_node=4, batch=8, seq=128)
    result = planner.plan(req)
    assert result.fits and all(o.dp * o.tp * o.pp * o.cp == 4 for o in result.fits)


def test_a_cached_hub_id_plans_offline(tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = tmp_path / "hub" / "models--labkit-test--tiny-bloom"
    (folder / "snapshots" / commit).mkdir(parents=True)
    (folder / "snapshots" / commit / "config.json").write_text(json.dumps(TINY["bloom"]))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    data = __import__("labkit.cli.plan", fromlist=["run_plan"]).run_plan(
        model="labkit-test/tiny-bloom", gpus=2, gpus_per_node=2, batch=4, seq=64, dp=2, zero=1)
    assert data["layout"][0]["fits"]


def test_models_the_planner_cannot_split_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 8}))
    with pytest.raises(ConfigError, match="not a causal language model"):
        planner.PlanRequest(model=str(tmp_path), gpus=8, gpus_per_node=8)
    gptj = tmp_path / "gptj"
    gptj.mkdir()
    (gptj / "config.json").write_text(json.dumps(dict(model_type="gptj", n_embd=64, n_layer=2, n_head=4,
                                                      vocab_size=300, n_positions=128, rotary_dim=8)))
    with pytest.raises(ConfigError, match="layers are not modelled"):
        planner.PlanRequest(model=str(gptj), gpus=8, gpus_per_node=8)
    with pytest.raises(ConfigError, match="vision model"):
        planner.PlanRequest(model="resnet50", gpus=8, gpus_per_node=8)


def _run(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    out, err = capsys.readouterr()
    return info.value.code, out, err


def test_cli_switches_reach_the_time_model(capsys):
    base = ["plan", "--model", "gpt3-175b", "--gpus", "512", "--gpus-per-node", "8", "--batch", "512", "--json",
            "--tp", "8", "--pp", "8", "--dp", "8"]
    step = {}
    for name, extra in (("plain", []), ("interleave", ["--interleave", "2"]), ("no-flash", ["--no-flash"]),
                        ("no-sp", ["--no-sequence-parallel"]), ("slow-net", ["--inter-node-gbps", "25"]),
                        ("zero2", ["--zero", "2"]), ("zero3", ["--zero", "3", "--fsdp"])):
        code, out, err = _run(base + extra, capsys)
        assert code == 0, err
        data = json.loads(out)
        step[name] = data["layout"][0]
    assert step["interleave"]["bubble"] < step["plain"]["bubble"]
    assert step["no-flash"]["step_s"] > step["plain"]["step_s"]
    assert step["no-sp"]["memory_gb"] > step["plain"]["memory_gb"]
    assert step["slow-net"]["step_s"] > step["plain"]["step_s"]
    assert step["zero3"]["dp_comm_s"] > step["zero2"]["dp_comm_s"] > 0  # ZeRO with PP: allowed, priced
    assert data["assumption"]["inter_node_gbps"] == 200


@pytest.mark.parametrize("gpu,peak", [("h100-sxm", 989), ("h200", 989), ("b200", 2250), ("h100-80gb", 989)])
def test_new_gpus_and_fp8(gpu, peak, capsys):
    code, out, err = _run(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpus-per-node", "8", "--gpu", gpu,
                           "--batch", "16", "--seq", "4096", "--json", "--top", "1"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["assumption"]["peak_tflops"] == peak and data["assumption"]["inter_node_gbps"] == 400
    code, out, err = _run(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpus-per-node", "8", "--gpu", gpu,
                           "--batch", "16", "--seq", "4096", "--precision", "fp8", "--top", "1"], capsys)
    assert code == 0 and "assumes fp8 matmuls" in out and "MAMF fp8 / bf16" in out  # derived, and says how
    code, _, err = _run(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpus-per-node", "8", "--precision", "fp8"],
                        capsys)
    assert code == 2 and "no FP8 tensor cores" in err


def test_published_models_by_name_and_meta_s_layout_fits(capsys):
    code, out, err = _run(["plan", "--model", "llama3-405b", "--gpus", "8192", "--gpus-per-node", "8", "--gpu",
                           "h100-sxm", "--tp", "8", "--pp", "16", "--dp", "64", "--zero", "2", "--interleave", "8",
                           "--seq", "8192", "--batch", "2048", "--checkpointing", "none", "--json"], capsys)
    assert code == 0, err
    mb1 = next(o for o in json.loads(out)["layout"] if o["micro_batch"] == 1)
    assert mb1["fits"] and 130 < mb1["tokens_per_s_per_gpu"] < 195  # Dubey et al. Table 4: 430 TFLOPS = ~162
    for name in ("llama3-70b", "llama-65b", "bloom-176b", "opt-175b", "mt-nlg-530b"):
        spec = planner.model_spec_of(name)
        assert 60e9 < spec.params < 560e9, name
