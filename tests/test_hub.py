"""Hugging Face ids through a local HF cache (HF_HUB_OFFLINE=1, no network), `labkit fetch`, and the
dtype a checkpoint is loaded in (issue 14, finding 8: transformers 5 keeps the saved dtype otherwise)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from labkit.zoo import fetch, hub
from labkit.cli import main
from labkit.errors import ConfigError

REPO = "labkit-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_hf_cache(home, repo: str = REPO, dtype=torch.float16):
    """A HF cache holding `repo`: tiny-llama saved in `dtype` (the standard hub layout, no network)."""
    from labkit.zoo.models import build_llm

    folder = home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / COMMIT
    build_llm("tiny-llama").to(dtype).save_pretrained(snapshot)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf_home")
    make_hf_cache(home)
    return home


@pytest.fixture
def offline(hf_home, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("LABKIT_FOOD11", str(tmp_path / "no-food11"))
    return hf_home


def _cli(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def test_a_cached_id_resolves_to_its_snapshot_and_config(offline):
    from labkit.zoo.models import checkpoint_dir, is_llm, llm_config
    from labkit.train.config import model_kind

    snapshot = offline / "hub" / "models--labkit-test--tiny-llama" / "snapshots" / COMMIT
    assert hub.is_hub_id(REPO) and not hub.is_hub_id("tiny-llama") and not hub.is_hub_id(str(snapshot))
    assert checkpoint_dir(REPO) == snapshot
    assert is_llm(REPO) and model_kind(REPO) == "llm"
    assert llm_config(REPO).vocab_size == 256


def test_an_uncached_id_is_one_line_naming_labkit_fetch(offline, capsys):
    code, _, err = _cli(["train", "--strategy", "single", "--model", "org/not-cached", "--steps", "1"], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "labkit fetch org/not-cached" in err and "HF_HUB_OFFLINE=1" in err


def test_memory_estimate_and_trace_read_only_the_config(offline, capsys):
    code, out, _ = _cli(["memory", "estimate", "--model", REPO, "--json"], capsys)
    assert code == 0
    by_id = json.loads(out)
    _, out, _ = _cli(["memory", "estimate", "--model", "tiny-llama", "--json"], capsys)
    by_preset = json.loads(out)
    # the checkpoint is tiny-llama saved: the same parameter count and bytes as the preset
    assert by_id["params"] == by_preset["params"] and by_id["per_gpu_bytes"] == by_preset["per_gpu_bytes"]
    code, out, _ = _cli(["memory", "trace", "--model", REPO, "--batch", "2", "--seq", "16", "--json"], capsys)
    assert code == 0 and json.loads(out)["params"] == by_id["params"]


def test_train_loads_a_cached_id_with_from_pretrained(offline, tmp_path):
    from labkit.train import run

    record = run("single", REPO, steps=3, data="tiny", out=str(tmp_path), progress=False)
    assert record.model == REPO and len(record.losses) == 3
    assert record.losses[-1] < record.losses[0]


@pytest.mark.parametrize("saved", [torch.float16, torch.bfloat16])
def test_full_fine_tune_params_are_fp32_whatever_the_checkpoint_was_saved_in(saved, tmp_path, monkeypatch):
    from labkit.parallel.loading import build_on_rank0
    from labkit.train.config import TrainConfig

    make_hf_cache(tmp_path, "labkit-test/saved", dtype=saved)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hook = _hook(TrainConfig.of(strategy="single", model="labkit-test/saved", amp="bf16"))
    assert {p.dtype for p in hook.model.parameters()} == {torch.float32}
    # memory-efficient loading: rank 0 loads, the meta ranks must build the same dtype (not the config's)
    for rank in (0, 1):
        assert {p.dtype for p in build_on_rank0("labkit-test/saved", rank).parameters()} == {torch.float32}


@pytest.mark.parametrize("amp, base", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("none", torch.float32)])
def test_a_frozen_lora_base_loads_in_the_compute_dtype(offline, amp, base):
    from labkit.train.config import TrainConfig

    hook = _hook(TrainConfig.of(strategy="lora", model=REPO, amp=amp))
    frozen = {p.dtype for p in hook.model.parameters() if not p.requires_grad}
    trained = {p.dtype for p in hook.model.parameters() if p.requires_grad}
    assert frozen == {base} and trained == {torch.float32}  # adapters keep an fp32 copy for AdamW


def _hook(cfg):
    from labkit import parallel
    from labkit.train.data import make_task
    from labkit.train.worker import local_context

    cfg = cfg.resolve()
    hook = parallel.make_strategy(cfg.run.strategy, local_context(cfg), cfg, make_task(cfg))
    hook.setup()
    return hook


def test_fetch_of_a_cached_model_does_not_download(offline, capsys, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", _no_network)
    code, out, _ = _cli(["fetch", REPO], capsys)
    assert code == 0 and "already cached" in out and COMMIT in out


def test_fetch_offline_of_an_uncached_model_or_set_names_the_fix(offline, capsys):
    for target in ("org/not-cached", "dolly"):
        code, _, err = _cli(["fetch", target], capsys)
        assert code == 2 and err.count("\n") == 1 and "HF_HUB_OFFLINE" in err and f"labkit fetch {target}" in err
    code, _, err = _cli(["fetch", "not-a-thing"], capsys)
    assert code == 2 and "food11" in err


def _no_network(*args, **kwargs):
    raise AssertionError("the network must not be used")


def test_status_says_what_is_cached_for_a_gpu_profile(offline, tmp_path):
    from labkit.profiles import get_profile

    make_hf_cache(offline, fetch.PRETRAINED["tinyllama-1.1b"])  # stands in for TinyLlama's weights
    items = {i.name: i for i in fetch.status(get_profile("a100x4"))}
    assert items[fetch.PRETRAINED["tinyllama-1.1b"]].present
    assert not items[fetch.PRETRAINED["llama2-7b"]].present and not items["Food-11"].present
    table = fetch.table(get_profile("a100x4"))
    assert "MISSING" in table and "labkit fetch food11" in table and "labkit fetch meta-llama/Llama-2-7b-hf" in table
    assert all(i.present for i in fetch.status(get_profile("smoke")))


def test_gpu_profiles_pick_pretrained_weights_and_real_data_only_when_cached(offline, capsys, tmp_path):
    from labkit.profiles import get_profile

    gpu, smoke = get_profile("a100x1"), get_profile("smoke")
    assert fetch.pretrained_llm(smoke) == smoke.llm_model
    assert fetch.pretrained_llm(gpu, "llama2-7b") == gpu.llm_model  # not cached: random init, said so
    assert "random init: `labkit fetch meta-llama/Llama-2-7b-hf`" in capsys.readouterr().out
    make_hf_cache(offline, fetch.PRETRAINED["tinyllama-1.1b"])
    assert fetch.pretrained_llm(gpu) == fetch.PRETRAINED["tinyllama-1.1b"]
    assert fetch.pretrained_llm(gpu, "llama2-7b", "tinyllama-1.1b") == fetch.PRETRAINED["tinyllama-1.1b"]
    assert fetch.pretrained_llm(gpu, "llama2-7b", fallback=None) is None
    assert fetch.image_data(gpu) == "synthetic" and fetch.text_data(gpu) == "tiny"
    out = capsys.readouterr().out
    assert "pretrained weights" in out and "synthetic images" in out and "data: tiny" in out


def test_an_instruction_set_trains_from_the_cache_with_a_held_out_loss(offline, tmp_path):
    """'dolly' from a dataset repo in the HF cache (here a 200-record stand-in), tokenized as text."""
    from labkit.train import run

    folder = offline / "hub" / "datasets--databricks--databricks-dolly-15k"
    (folder / "snapshots" / COMMIT).mkdir(parents=True, exist_ok=True)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    records = [{"instruction": f"Add {i} and {i}.", "context": "", "response": f"{i} + {i} = {2 * i}."}
               for i in range(200)]
    (folder / "snapshots" / COMMIT / "databricks-dolly-15k.jsonl").write_text(
        "\n".join(json.dumps(r) for r in records))
    from labkit.profiles import get_profile

    assert fetch.text_data(get_profile("a100x1")) == "dolly"
    record = run("lora", REPO, steps=6, data="dolly", out=str(tmp_path), progress=False, lr=1e-2,
                 eval_at_start=True)
    assert record.train.eval_loss < record.train.eval_start_loss  # the held-out loss improves
    shutil.rmtree(folder)
    with pytest.raises(ConfigError, match="labkit fetch dolly"):
        run("lora", REPO, steps=1, data="dolly", out=str(tmp_path), progress=False)


def test_memory_estimate_of_an_uncached_id_is_one_line(offline, capsys):
    code, _, err = _cli(["memory", "estimate", "--model", "org/not-cached", "--json"], capsys)
    assert code == 2 and err.count("\n") == 1 and "labkit fetch org/not-cached" in err


def test_online_fetch_downloads_safetensors_only_unless_the_repo_has_none(offline, monkeypatch, tmp_path):
    """The download call itself needs the network (unverified here); its arguments and fallback are checked."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def fake_snapshot_download(repo_id, *, cache_dir, allow_patterns=None, local_files_only=False, **kw):
        if local_files_only:
            from huggingface_hub.errors import LocalEntryNotFoundError
            raise LocalEntryNotFoundError("not cached")
        calls.append(list(allow_patterns))
        folder = tmp_path / repo_id.replace("/", "--")
        folder.mkdir(exist_ok=True)
        if "*.bin" in allow_patterns:  # this repository ships pytorch_model.bin only
            (folder / "pytorch_model.bin").write_bytes(b"0")
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    where, what = fetch.fetch("org/bin-only")
    assert what == "downloaded" and where.endswith("org--bin-only")
    assert "*.safetensors" in calls[0] and "*.bin" not in calls[0] and "*.bin" in calls[1]


def test_hub_errors_name_the_fix():
    from huggingface_hub import errors

    class Response:  # what huggingface_hub's HTTP errors carry
        status_code, headers, url, request = 401, {}, "https://huggingface.co", None

        def json(self):
            return {}

    with pytest.raises(ConfigError, match="accept its license.*HF_TOKEN"):
        with hub.hub_errors("meta-llama/Llama-2-7b-hf"):
            raise errors.GatedRepoError("gated", response=Response())
    with pytest.raises(ConfigError, match="check the spelling"):
        with hub.hub_errors("org/typo"):
            raise errors.RepositoryNotFoundError("404", response=Response())
