"""Notebook 06 on a 16 GB T4 (issue 29): QLoRA of Llama-2-7B when the learner fetched it, TinyLlama's walk
otherwise. The estimator's verdict and the fetch line in process; one rehearsal of 06 on t4x1 with a local
HF cache that holds a stand-in Llama-2-7B snapshot (its real config.json, a token weight file: a rehearsal
never reads weights) shows the 7B's run sized at its real size and fitting the T4."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from labkit.zoo import fetch, hub
from labkit.profiles import get_profile

ROOT = Path(__file__).resolve().parent.parent
LLAMA_7B = fetch.PRETRAINED["llama2-7b"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
#: LoRA / QLoRA of the 7B as 06's `attempt` makes them on a T4: the walk's micro-batches, checkpointing, 16 GB cap.
T4_RUN = dict(memory_cap_gb=16.0, accum=4, checkpointing=True)


def make_llama2_7b_cache(home: Path) -> Path:
    """A HF cache holding meta-llama/Llama-2-7b-hf: the real config.json (from labkit's preset, which is
    its published config) and a token safetensors file, so `hub.has_weights` holds. No tokenizer: the
    stand-in trains on bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from labkit.zoo.presets import LLM_PRESETS

    folder = home / "hub" / ("models--" + LLAMA_7B.replace("/", "--"))
    snapshot = folder / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**LLM_PRESETS["llama2-7b"], architectures=["LlamaForCausalLM"]).save_pretrained(snapshot)
    save_file({"stand_in": torch.zeros(1)}, str(snapshot / "model.safetensors"))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hf_offline(monkeypatch, tmp_path):
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return home


def test_the_estimator_sizes_the_cached_7b_as_the_preset_and_only_qlora_fits_a_t4(hf_offline):
    from labkit.memory.params import model_spec
    from labkit.parallel import peft

    make_llama2_7b_cache(hf_offline)
    spec, preset = model_spec(LLAMA_7B), model_spec("llama2-7b")
    assert (spec.params, spec.arch["hidden"], spec.num_blocks) == (preset.params, 4096, 32)
    assert 6.7e9 < spec.params < 6.8e9
    by_id = peft.sized(LLAMA_7B, ("lora", "qlora"), "t4x1", **T4_RUN)
    by_preset = peft.sized("llama2-7b", ("lora", "qlora"), "t4x1", **T4_RUN)
    assert [v["bytes"] for v in by_id.values()] == [v["bytes"] for v in by_preset.values()]
    lora, qlora = by_preset["lora"], by_preset["qlora"]
    assert lora["capacity"] == qlora["capacity"] == pytest.approx(0.85 * 16e9)
    assert not lora["fits"] and lora["bytes"] > 13e9  # the fp16 base alone is 13.5 GB
    assert qlora["fits"] and 3e9 < qlora["bytes"] < 8e9
    text = peft.format_sized(by_preset)
    assert text.count("\n") == 1 and "-> does not fit" in text.splitlines()[0] and text.endswith("-> fits")
    assert "13.6 GB (85% of 16 GB)" in text
    assert "not sized (no GPU)" in peft.format_sized(peft.sized("llama2-7b", ("qlora",), "smoke"))


def test_the_7b_is_used_when_cached_and_otherwise_one_line_says_how_to_get_it(hf_offline, capsys):
    t4, smoke = get_profile("t4x1"), get_profile("smoke")
    assert fetch.cached_pretrained(t4, "llama2-7b") is None
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and f"labkit fetch {LLAMA_7B}" in line and "13.5 GB" in line and "Colab" in line
    make_llama2_7b_cache(hf_offline)
    assert hub.has_weights(hub.cached_snapshot(LLAMA_7B))
    assert fetch.cached_pretrained(t4, "llama2-7b") == LLAMA_7B
    assert "pretrained weights from the Hugging Face cache" in capsys.readouterr().out
    assert fetch.cached_pretrained(smoke, "llama2-7b") is None  # smoke never trains a checkpoint


@pytest.mark.slow
def test_06_on_a_t4_rehearses_qlora_of_the_fetched_7b_at_its_real_size(hf_offline, monkeypatch, tmp_path):
    from labkit.course import notebooks as nbk
    from labkit.course import rehearse

    make_llama2_7b_cache(hf_offline)
    monkeypatch.setenv("LABKIT_RUNS", str(tmp_path / "runs"))
    run = nbk.run_notebook(ROOT / "notebooks" / "06_peft.ipynb", profile="t4x1", out_dir=tmp_path / "t4x1",
                           rehearse=True)
    if not run.ok:
        pytest.fail(f"{run.describe()}\n{run.traceback[-3000:]}", pytrace=False)
    observed = rehearse.observed_runs(run.rehearsal_log, run.cells())
    seven_b = [r for r in observed if r.model == LLAMA_7B]
    assert [(r.strategy, r.label) for r in seven_b] == [("qlora", "qlora-7b")]
    (qlora,) = seven_b
    assert 3e9 < qlora.bytes < 8e9 and qlora.fits and qlora.capacity == pytest.approx(0.85 * 16e9)  # the real 7B
    assert qlora.options == {"accum": 4, "checkpointing": True, "memory_cap_gb": 16.0, "amp": "fp16", "nproc": 1}
    # the walk itself is TinyLlama's, as without the 7B (the manifest's t4x1 rows)
    walk = [r.row() for r in observed if r.model != LLAMA_7B]
    assert walk == [r for r in rehearse.manifest_rows("t4x1") if r["lab"] == "06_peft"]
    executed = nbformat.read(run.output, as_version=4)
    text = "".join(o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"model: {LLAMA_7B} (pretrained weights" in text and "is not cached" not in text
