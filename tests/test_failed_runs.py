"""A rank that fails must not hang its peers (issue 38, G4), and MFU has a peak on every profile (G8).

G4: after a rank raised, destroying its process groups waits for peers still inside a collective
(pytorch#141510), for as long as the groups' timeout (an hour on the class profiles before). So a failed
run destroys nothing (NCCL's groups are aborted; gloo's are left to the process's exit), a finished one
destroys its groups; the collectives' timeout is minutes, the wall limit of a whole run stays long.
One process on torch's fake process group (4 ranks' groups, no peers): what is destroyed is what counts.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labkit.runtime import device as devices
from labkit.course import preflight
from labkit.parallel.single import DistContext
from labkit.profiles import PROFILES, get_profile
from labkit.train import loop, metrics, worker
from labkit.train.api import make_config, process_group


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    yield DistContext(rank=0, world_size=4, local_rank=0, device=torch.device("cpu"), group=dist.group.WORLD)
    if dist.is_initialized():
        dist.destroy_process_group()


def _live_groups() -> set:
    return set(dist.distributed_c10d._world.pg_map)  # where destroy_process_group removes a group from


def _run_building_a_mesh(monkeypatch, fake_world, fail: bool):
    made = []

    def fake_train(cfg, ctx):  # labkit's own inner loop replaced: a run that builds a 2x2 mesh, then ends
        before = _live_groups()
        devices.mesh("cpu", (2, 2), ("dp", "tp"))
        made.extend(_live_groups() - before)
        if fail:
            raise RuntimeError("rank 0 failed in step 3")
        return "record"

    monkeypatch.setattr(loop, "_train", fake_train)
    cfg = make_config("single", "tiny-llama", steps=1)
    return made, (lambda: loop.train(cfg, fake_world))


def test_a_failed_run_destroys_none_of_its_groups(monkeypatch, fake_world):
    made, run = _run_building_a_mesh(monkeypatch, fake_world, fail=True)
    with pytest.raises(RuntimeError, match="step 3"):
        run()
    assert made and set(made) <= _live_groups()  # nothing destroyed: a peer may still wait in them
    assert devices.mesh_count() == 0  # and the next run of a launch does not release them later


def test_a_finished_run_destroys_its_groups(monkeypatch, fake_world):
    made, run = _run_building_a_mesh(monkeypatch, fake_world, fail=False)
    assert run() == "record"
    assert made and not set(made) & _live_groups()


def test_the_rank_entry_destroys_the_world_only_after_a_success(fake_world):
    def fails(ctx):
        raise ValueError("bad batch")

    with pytest.raises(ValueError):
        worker.run_then_leave(fails, fake_world)
    assert dist.is_initialized()  # not destroyed (gloo/fake: no abort; NCCL's would be aborted)
    worker.run_then_leave(lambda ctx: None, fake_world)
    assert not dist.is_initialized()


@pytest.mark.parametrize("name", [n for n in PROFILES if get_profile(n).device == "cuda"])
def test_class_profiles_time_collectives_out_in_minutes(name):
    prof = get_profile(name)
    assert prof.collective_timeout_s <= 15 * 60 < prof.timeout_s
    assert process_group(make_config("ddp", "tiny-llama", profile="smoke")).endswith("/300")  # the pools' key


def test_preflight_launches_are_bounded_in_minutes_a_run():
    prof = get_profile("a100x4")
    runs = len([r for r in preflight.runs_for(prof) if r[0] != "single"])
    assert runs > 2 and preflight.launch_limit(prof, runs) <= (runs + 2) * preflight.RUN_LIMIT_S < prof.timeout_s * runs
    assert preflight.launch_limit(prof, 1) < 15 * 60
    smoke = get_profile("smoke")  # a CPU launch keeps its own (slower) limit per run
    assert preflight.launch_limit(smoke, 20) == min(smoke.timeout_s * 20, preflight.launch_limit(prof, 20))


# ------------------------------------------------------------------------------------------ G8
def test_a_t4_has_a_peak():
    assert metrics.peak_for("Tesla T4", "float16") == 65.0
    assert metrics.peak_for("Tesla T4", "bfloat16") == 0.0  # Turing has no bf16 tensor cores


def test_the_profiles_peak_backs_the_table():
    assert loop._profile_peak(make_config("single", "tiny-llama", profile="smoke").resolve()) == 0.0
    cfg = make_config("single", "tiny-llama", profile="t4x1", amp="fp16")
    assert loop._profile_peak(cfg) == get_profile("t4x1").peak_tflops == 65.0
    assert loop._profile_peak(make_config("single", "tiny-llama", profile="t4x1", amp="none")) == 0.0
