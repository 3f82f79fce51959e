"""The training loop in one process: losses fall, accumulation is exact, errors name the fix, data sharding."""
from __future__ import annotations

from types import MappingProxyType

import numpy as np
import pytest
import torch

from labkit import cli, parallel
from labkit.errors import ConfigError
from labkit.train import metrics, run
from labkit.train.api import make_config
from labkit.train.batch_finder import find_max_batch, search_max
from labkit.train.data import (TINY_TEXT, StepLoader, SyntheticImages, SyntheticTokens, build_datasets,
                               make_task)


def run_main(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    return info.value.code, capsys.readouterr().err


# ------------------------------------------------------------------ training behaviour
def test_threads_reach_every_rank_of_a_launch(monkeypatch, tmp_path):
    # --threads N is each launched rank's OMP_NUM_THREADS (labkit.runtime.launch._child_env); without it, the
    # strategy's default (labkit.runtime.launch.cpu_threads). The launch itself is replaced: only the count is checked.
    from labkit.runtime import rank_pool
    from labkit.train import api

    seen = []
    monkeypatch.setattr(rank_pool, "run", lambda *a, **kw: seen.append(kw["threads"]))
    monkeypatch.setattr(api, "record_of", lambda *a: None)
    for threads in (3, None):
        run("ddp", "tiny-llama", nproc=2, threads=threads, out=str(tmp_path), progress=False)
    assert seen == [3, 1]


def test_tiny_resnet_losses_fall(tmp_path):
    threads = torch.get_num_threads()
    record = run("single", "tiny-resnet", steps=8, out=str(tmp_path), progress=False, threads=1)
    assert torch.get_num_threads() == threads  # --threads 1 in this process, the caller's count given back
    (cpu,) = record.train.cpu_step_time_s  # one rank: its median CPU-seconds of a steady step
    assert 0 < cpu and 0 < metrics.cpu_share(record)[0] < 1.5
    assert record.steps == 8 and np.isfinite(record.losses).all()
    assert np.mean(record.losses[-3:]) < 0.7 * np.mean(record.losses[:3])
    # The measured FLOPs (FlopCounterMode, warm-up step) and the projection are filled in.
    assert record.train.flops_per_step > 0 and record.train.epoch_time_s > 0
    assert record.peak_bytes[0] >= record.param_bytes[0] + record.grad_bytes[0]
    assert record.mfu == 0.0  # no peak FLOPS for a CPU


def test_accumulating_two_half_batches_equals_one_full_batch(tmp_path):
    full = run("single", "tiny-llama", steps=4, out=str(tmp_path), progress=False)
    halves = run("single", "tiny-llama", steps=4, out=str(tmp_path), accum=2, progress=False)
    assert halves.train.micro_batch == full.train.micro_batch // 2
    np.testing.assert_allclose(halves.losses, full.losses, rtol=1e-5, atol=1e-6)


def test_levers_train_and_are_recorded(tmp_path):
    record = run("single", "tiny-resnet", steps=3, out=str(tmp_path), amp="bf16", checkpointing=True,
                 channels_last=True, accum=2, progress=False)
    assert record.dtype == "bfloat16" and np.isfinite(record.losses).all()
    assert record.train.activation_checkpointing and record.train.channels_last


def test_shipped_tiny_data_trains_both_kinds(tmp_path):
    text = run("single", "tiny-llama", steps=3, out=str(tmp_path), data="tiny", progress=False)
    images = run("single", "tiny-resnet", steps=2, batch=8, out=str(tmp_path), data="tiny", progress=False)
    assert text.train.dataset_size == (int(len(TINY_TEXT.read_bytes()) * 0.9) - 1) // 32
    assert images.train.dataset_size == 16  # labkit/data/tiny_images: 2 classes x 8 PNGs
    assert np.isfinite(text.losses + images.losses).all()


# ------------------------------------------------------------------ errors name the valid values
@pytest.mark.parametrize("argv, expected", [
    (["--strategy", "bogus", "--model", "tiny-llama"], "valid strategies are: single, ddp, fsdp"),
    (["--strategy", "ddp", "--model", "bogus"], "valid models are: "),
    (["--strategy", "single", "--model", "tiny-llama", "--nproc", "2"], "use --nproc 1"),
    (["--strategy", "single", "--model", "tiny-llama", "--batch", "6", "--accum", "4"], "multiple of 4"),
    (["--strategy", "single", "--model", "tiny-llama", "--channels-last"], "image models"),
])
def test_bad_settings_exit_2_with_a_message_naming_the_fix(argv, expected, capsys):
    code, err = run_main(["train", *argv], capsys)
    assert code == 2 and expected in err, err
    if expected == "valid models are: ":
        assert "tiny-resnet" in err and "tiny-llama" in err


def test_a_registered_strategy_without_its_module_is_not_available_yet(monkeypatch, capsys):
    future = MappingProxyType({**parallel.STRATEGIES, "warp-drive": ("warp_drive", "future")})
    monkeypatch.setattr(parallel, "STRATEGIES", future)
    code, err = run_main(["train", "--strategy", "warp-drive", "--model", "tiny-llama"], capsys)
    assert code == 2 and "'warp-drive' is not available yet in this labkit" in err
    assert "available now: single, ddp" in err


def test_profile_defaults_and_overrides(tmp_path):
    cfg = make_config("ddp", "tiny-resnet", nproc=2)
    assert (cfg.optim.batch, cfg.precision.amp, cfg.run.steps, cfg.run.image_size) == (16, "none", 20, 32)
    assert make_config("ddp", "tiny-llama", nproc=2, batch=4, amp="bf16").optim.batch == 4
    with pytest.raises(ConfigError, match="unknown train option 'stepz'"):
        make_config("single", "tiny-llama", stepz=3)


# ------------------------------------------------------------------ data sharding
def _step_samples(dataset, *, dp_size: int, steps: int, start: int = 0, batch: int = 8) -> list[set]:
    loaders = [iter(StepLoader(dataset, global_batch=batch, dp_rank=r, dp_size=dp_size, seed=3, start_step=start))
               for r in range(dp_size)]
    out = []
    for _ in range(steps):
        parts = [next(it)[0] for it in loaders]
        out.append({tuple(row.tolist()) for part in parts for row in part})
    return out


def test_the_global_batch_is_the_same_samples_for_any_world_size():
    tokens = SyntheticTokens(40, 4, 256, seed=1)  # 5 steps per epoch: also crosses epochs
    one = _step_samples(tokens, dp_size=1, steps=12)
    assert _step_samples(tokens, dp_size=2, steps=12) == one
    assert _step_samples(tokens, dp_size=4, steps=12) == one
    assert _step_samples(tokens, dp_size=2, steps=5, start=7) == one[7:12]  # resume mid-epoch
    assert len({frozenset(s) for s in one[:5]}) == 5  # distinct batches within an epoch


def test_synthetic_samples_are_deterministic_and_datasets_have_held_out_data():
    a, b = SyntheticImages(10, 16, 4, seed=0), SyntheticImages(10, 16, 4, seed=0)
    assert torch.equal(a[3][0], b[3][0]) and a[3][1] == b[3][1]
    cfg = make_config("single", "tiny-llama", data=str(TINY_TEXT))
    train, held = build_datasets(cfg, make_task(cfg))
    assert len(train) > 8 * len(held) > 0


# ------------------------------------------------------------------ measurement helpers
def test_median_step_time_excludes_warmup_and_measured_steps():
    times = [9.0, 7.0, 1.0, 2.0, 3.0]
    assert metrics.median_step_time(times, skip={0, 1}, warmup=2) == 2.0
    assert metrics.median_step_time([5.0, 1.0], skip={0}, warmup=2) == 1.0


def test_intra_op_threads_are_set_and_restored():
    before = torch.get_num_threads()
    with metrics.intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def _timed(ranks: int, step_s: float, cpu_s: list[float], batch: int = 16):
    from labkit.facts import TrainFacts
    from labkit.results import RunRecord

    return RunRecord(strategy="ddp", model="tiny-resnet", profile="smoke", world_size=ranks, steps=8, losses=[1.0],
                     step_time_s=step_s, samples_per_s=batch / step_s, peak_bytes=[1] * ranks, param_bytes=[1] * ranks,
                     grad_bytes=[1] * ranks, optimizer_bytes=[1] * ranks, trainable_params=1, device="cpu",
                     dtype="float32", global_batch=batch, train=TrainFacts(cpu_step_time_s=cpu_s))


def test_work_efficiency_counts_cpu_time_which_other_processes_do_not_change():
    # A 1-rank baseline that got a fifth of a core on a busy machine: 2 ranks look 2.5x "better than ideal"
    # on the wall clock, while the CPU time says the two ranks did 25 % more work than the one.
    one, two = _timed(1, 2.0, [0.4]), _timed(2, 0.4, [0.25, 0.25])
    assert metrics.wall_efficiency(one, two) == pytest.approx(2.5)
    assert metrics.work_efficiency(one, two) == pytest.approx(0.8)
    assert metrics.cpu_share(one) == pytest.approx([0.2]) and metrics.cpu_share(two) == pytest.approx([0.625] * 2)
    assert metrics.work_efficiency(one, _timed(2, 0.4, [])) is None  # a record without CPU times


def test_resident_bytes_counts_each_storage_once_on_its_device():
    model = torch.nn.Linear(10, 10)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    got = metrics.resident_bytes(model, opt, torch.device("cpu"))
    assert got.param == got.grad == 110 * 4
    assert got.optimizer == 2 * 110 * 4 + 2 * 4  # exp_avg, exp_avg_sq and a scalar step per tensor
    assert metrics.mfu(312e12, 1.0, 1, 312.0) == pytest.approx(1.0)


@pytest.mark.parametrize("limit_true", [1, 2, 5, 17, 64, 100])
def test_search_max_finds_the_boundary_with_few_probes(limit_true):
    probes = []
    best = search_max(lambda b: probes.append(b) or b <= limit_true, limit=4096)
    assert best == limit_true
    assert len(probes) <= 2 * int(np.log2(limit_true) + 2)


def test_max_batch_finder_against_a_cpu_budget():
    report = find_max_batch("tiny-llama", budget_mb=2.5)
    best, probes = report["max_micro_batch"], dict((b, p) for b, p in report["probes"])
    assert best >= 1 and probes[best] <= 2.5 * 2**20
    assert all(p > 2.5 * 2**20 for b, p in probes.items() if b > best)  # every larger probe really exceeded it
    with pytest.raises(ConfigError, match="budget"):
        find_max_batch("tiny-llama")
