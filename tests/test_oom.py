"""The OOM playbook: levers in the taught order, kept one on top of the other, stop at the first fit."""
from __future__ import annotations

import pytest

from labkit.profiling import oom
from labkit.memory.estimate import MemoryConfig, estimate

GB = oom.GB
ORDER = [lever.name for lever in oom.LEVERS]


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    return oom.scenarios(tmp_path_factory.mktemp("configs"))


def check_path(pb: oom.Playbook) -> None:
    """Kept levers follow the taught order, never raise the estimate, and only the last one fits."""
    kept = [m for m in pb.moves if m.status == "kept"]
    assert [ORDER.index(m.lever) for m in kept] == sorted(ORDER.index(m.lever) for m in kept)
    totals = [pb.start.total] + [m.estimate.total for m in kept]
    assert totals == sorted(totals, reverse=True)
    assert [m.fits for m in kept] == [False] * (len(kept) - 1) + [True]
    assert pb.final.total <= pb.capacity


def test_7b_full_finetune_on_a_4090_walks_the_levers_in_order(scenarios):
    cfg, gpu, host, title = scenarios["7b-on-4090"]
    pb = oom.playbook(cfg, gpu, host_bytes=host, title=title, measure=False)
    assert not pb.start.fits(gpu) and pb.fits
    check_path(pb)
    assert pb.path[:3] == ORDER[:3]  # mixed precision, activation checkpointing, gradient accumulation
    # 64 GB of host RAM cannot hold ZeRO-Offload's states: skipped, not kept.
    skipped = [m for m in pb.moves if m.status == "skipped"]
    assert skipped and all("host RAM" in m.note and m.estimate.cpu_bytes > host for m in skipped)
    assert not set(m.lever for m in skipped) & set(pb.path)
    text = pb.text
    assert "profile first: the largest part is" in text and "path: mixed precision" in text and "FITS" in text


def test_with_enough_host_ram_offload_is_the_way_out(scenarios):
    cfg, gpu, _, _ = scenarios["7b-on-4090"]
    pb = oom.playbook(cfg, gpu, host_bytes=None, measure=False)
    check_path(pb)
    assert pb.path[-1].startswith("offload") and "LoRA" not in " ".join(pb.path)


def test_a_configuration_that_fits_needs_no_lever_and_one_that_never_fits_says_so():
    small = oom.playbook(MemoryConfig(model="tiny-llama", batch=2, seq=32), 1 * GB, measure=False)
    assert small.fits and small.moves == () and small.path == []
    huge = oom.playbook(MemoryConfig(model="gpt3-175b", precision="fp32"), 24 * GB, host_bytes=64 * GB, measure=False)
    assert not huge.fits and "still does not fit" in huge.text


@pytest.fixture(scope="module")
def measured_70b(scenarios):
    cfg, gpu, host, title = scenarios["70b-on-2x24"]
    return oom.playbook(cfg, gpu, host_bytes=host, title=title)


def test_70b_on_two_24gb_gpus_needs_fsdp_and_qlora(measured_70b):
    pb = measured_70b
    check_path(pb)
    assert "shard over the GPUs (FSDP full_shard / ZeRO-3)" in pb.path and pb.path[-1] == "NF4 base (QLoRA)"
    final = pb.moves[-1].config
    assert (final.zero, final.dp, final.quant, final.lora_rank) == (3, 2, "nf4-dq", 8)
    # The estimator covers fsdp-qlora: sharding halves the per-GPU weights of the same QLoRA model.
    single = estimate(final.replace(zero=0, dp=1, gpus=None))
    assert estimate(final).weights == pytest.approx(single.weights / 2, rel=0.01)


def test_each_lever_is_measured_on_the_smoke_model_where_this_machine_can(measured_70b):
    measured = {m.lever: m.measured for m in measured_70b.moves if m.status == "kept"}
    ckpt = measured["activation checkpointing"]
    assert ckpt["what"] == "peak of one step" and ckpt["after"] < ckpt["before"]
    adam8 = measured["8-bit AdamW (bitsandbytes)"]  # real bitsandbytes state: 2 B instead of 8 B per param
    assert adam8["what"] == "optimizer state" and adam8["after"] < 0.4 * adam8["before"]
    nf4 = measured["NF4 base (QLoRA)"]
    assert nf4["what"] == "weights" and nf4["after"] < 0.7 * nf4["before"]
    assert "estimated only" in measured["shard over the GPUs (FSDP full_shard / ZeRO-3)"]["note"]
    assert "measured on tiny-llama" in measured_70b.text


@pytest.mark.parametrize("profile, gpu", [("a100x4", "A100 80GB"), ("v100x4", "V100 32GB")])
def test_llama2_7b_ddp_does_not_fit_where_fsdp_does_on_the_gpu_profiles(profile, gpu):
    from labkit.memory.report import GPU_CAPACITIES
    from labkit.profiles import get_profile

    prof = get_profile(profile)
    pair = oom.ddp_vs_fsdp("llama2-7b", prof.nproc, prof.seq_len)
    assert not pair["ddp"].fits(GPU_CAPACITIES[gpu]) and pair["fsdp"].fits(GPU_CAPACITIES[gpu])
