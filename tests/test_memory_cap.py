"""`--memory-cap-gb`: the "Llama-2-7B on a 24 GB GPU" scenario, on CPU against the tracked peak and on
CUDA through the allocator's per-process fraction (the CUDA calls are checked with stand-ins here)."""
from __future__ import annotations

import pytest
import torch

from labkit.cli import main
from labkit.errors import ConfigError
from labkit.train import memcap, run

# tiny-llama, smoke batch 8 x 32 tokens: a full fine-tune's tracked peak is ~4.5 MB, LoRA's ~2.9 MB.
CAP_GB = 0.0036


def test_full_fine_tune_runs_out_of_memory_under_the_cap_and_lora_fits(tmp_path):
    with pytest.raises(torch.cuda.OutOfMemoryError, match="--memory-cap-gb 0.0036") as info:
        run("single", "tiny-llama", steps=2, out=str(tmp_path), progress=False, memory_cap_gb=CAP_GB)
    assert isinstance(info.value, memcap.MemoryCapExceeded)  # OOM handlers catch it like a CUDA OOM
    lora = run("lora", "tiny-llama", steps=2, out=str(tmp_path), progress=False, memory_cap_gb=CAP_GB)
    assert 0 < max(lora.peak_bytes) <= CAP_GB * 1e9
    full = run("single", "tiny-llama", steps=2, out=str(tmp_path), progress=False)  # no cap: it trains
    assert max(full.peak_bytes) > CAP_GB * 1e9


def test_the_cli_reports_the_cap_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--strategy", "single", "--model", "tiny-llama", "--steps", "2", "--out", str(tmp_path),
              "--memory-cap-gb", str(CAP_GB)])
    err = capsys.readouterr().err  # the progress bar, then the error
    assert exit_.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith("error: out of memory under --memory-cap-gb 0.0036")


@pytest.mark.parametrize("cap", [0, -1.0, True])
def test_a_cap_must_be_a_positive_size(cap):
    from labkit.train.config import TrainConfig

    with pytest.raises(ConfigError, match="memory_cap_gb"):
        TrainConfig.of(strategy="single", model="tiny-llama", memory_cap_gb=cap)


def test_on_cuda_the_cap_is_the_allocators_fraction_for_the_run_only(monkeypatch):
    calls = []
    props = type("Props", (), {"total_memory": 80 * 10**9})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: calls.append(round(fraction, 6)))
    with memcap.applied(24.0, torch.device("cuda", 0)):
        assert calls == ["empty_cache", 0.3]  # 24 GB of an 80 GB A100
    assert calls[-1] == 1.0  # lifted afterwards: later runs in the same notebook are not capped
    calls.clear()
    with pytest.raises(RuntimeError):
        with memcap.applied(24.0, torch.device("cuda", 0)):
            raise RuntimeError("a failed run")
    assert calls[-1] == 1.0
    calls.clear()
    with memcap.applied(24.0, torch.device("cpu")), memcap.applied(None, torch.device("cuda", 0)):
        pass
    assert calls == []  # CPU and no cap: nothing to set
    assert memcap.fraction_of(100 * 10**9, 80 * 10**9) == 1.0


def test_check_passes_under_the_cap_and_names_the_levers_over_it():
    memcap.check(None, 10**12)
    memcap.check(1.0, 10**9)
    with pytest.raises(memcap.MemoryCapExceeded, match="lora or qlora"):
        memcap.check(1.0, 10**9 + 1)


@pytest.mark.parametrize("amp, dtype", [("none", "float32"), ("bf16", "bfloat16")])
def test_notebook_06s_scaled_cap_lets_lora_fit_and_stops_the_full_fine_tune(tmp_path, amp, dtype):
    from labkit.profiles import get_profile

    from labkit.memory.report import GPU_CAPACITIES
    # one number with the notebook's "fits in 24 GB" table: 24 GiB, as nvidia-smi reports a 4090
    assert memcap.scenario_cap_gb(get_profile("a100x1"), "llama2-7b") * 1e9 == GPU_CAPACITIES["RTX 4090 24GB"]
    cap = memcap.scenario_cap_gb(get_profile("smoke", dtype=dtype), "tiny-llama")
    common = dict(steps=2, out=str(tmp_path), progress=False, amp=amp, memory_cap_gb=cap)
    with pytest.raises(memcap.MemoryCapExceeded):
        run("single", "tiny-llama", **common)
    assert max(run("lora", "tiny-llama", **common).peak_bytes) <= cap * 1e9
