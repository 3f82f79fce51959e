"""Pipeline parallelism (labkit.parallel.pipeline) and its schedule diagram (labkit.viz.pipeline_schedule).

One spawned 2-rank gloo job (module fixture) trains tiny-llama 3 steps with GPipe and with 1F1B on
the same batches as the single-process reference; it reports losses, local parameter counts and the
measured schedule. One `labkit train --strategy pipeline-gpipe --accum 2` run checks the hook inside
the real training loop.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from _reference import BATCH, LR, SEQ, spawn_two_ranks, token_batches
from _reference import reference_losses as _reference_losses
from labkit.errors import ConfigError
from labkit.parallel import pipeline as P
from labkit.parallel.pipeline_trace import ScheduleTrace
from labkit.viz.pipeline_schedule import events_of, max_in_flight, measured_bubble, replay, text_schedule

STEPS, M = 3, 4


def batches():
    return token_batches(2, STEPS)


def reference_losses() -> list[float]:
    return _reference_losses(batches())


def _train(schedule: str) -> dict:
    import torch.distributed as dist

    from labkit.zoo.models import build_llm

    group = dist.group.WORLD
    stage = P.apply_pipeline(build_llm("tiny-llama", seed=0), group)
    pipe, sched = P.build_schedule(stage, group, schedule=schedule, microbatches=M, device=torch.device("cpu"),
                                   loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, -2), y.flatten()) / M)
    trace = ScheduleTrace(pipe)
    opt = torch.optim.AdamW(stage.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for x, y in batches():
        opt.zero_grad()
        trace.begin_step()
        out: list = []
        sched.step(*((x,) if pipe.is_first else ()), target=y if pipe.is_last else None, losses=out)
        trace.end_step()
        opt.step()
        losses.append(float(sum(out)) if out else None)
    steps = [None, None]
    dist.all_gather_object(steps, trace.steps)
    return {"losses": losses, "local_params": sum(p.numel() for p in stage.parameters()),
            "events": events_of([s[-1] for s in steps])}


def _checkpoint_roundtrip(out_dir: str) -> dict:
    """The hook's DCP save and load: a fresh hook loads what a trained one saved, stage by stage."""
    import torch.distributed as dist

    from labkit.parallel import make_strategy
    from labkit.parallel.single import DistContext
    from labkit.train.api import make_config
    from labkit.train.data import make_task

    cfg = make_config("pipeline-1f1b", "tiny-llama", nproc=2, microbatches=2, batch=BATCH, seq_len=SEQ)
    ctx = DistContext(dist.get_rank(), 2, dist.get_rank(), torch.device("cpu"), group=dist.group.WORLD)
    hooks = [make_strategy(cfg.run.strategy, ctx, cfg, make_task(cfg)) for _ in range(2)]
    for hook in hooks:
        hook.setup()
    hooks[0].train_step([batches()[0]], None)
    path = os.path.join(out_dir, "ckpt")
    hooks[0].save_checkpoint(path)
    same = lambda: all(torch.equal(a, b) for a, b in zip(*(h.model.parameters() for h in hooks)))  # noqa: E731
    before = same()  # False: hooks[0] took a step
    hooks[1].load_checkpoint(path)
    groups = hooks[1].optimizer.param_groups[0]
    return {"params_equal": same() and not before, "lr": groups.get("lr"), "steps": len(hooks[1].optimizer.state)}


def _results(out_dir: str) -> dict:
    """One rank's share of the module fixture (runs inside the 2-rank group)."""
    result = {s: _train(s) for s in ("gpipe", "1f1b")}
    result["checkpoint"] = _checkpoint_roundtrip(out_dir)
    return result


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    return spawn_two_ranks(_results, tmp_path_factory, "pp"), reference_losses()


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_losses_match_single_process(two_stages, schedule):
    ranks, ref = two_stages
    assert ranks[0][schedule]["losses"] == [None] * STEPS  # stage 0 has no loss
    assert ranks[1][schedule]["losses"] == pytest.approx(ref, rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_each_stage_holds_about_half_the_parameters(two_stages):
    from labkit.zoo.models import build_llm, count_params

    ranks, _ = two_stages
    full = count_params(build_llm("tiny-llama"))
    shares = [r["1f1b"]["local_params"] / full for r in ranks]
    assert sum(shares) == pytest.approx(1.0)  # nothing duplicated, nothing lost
    assert shares == pytest.approx([0.5, 0.5], abs=0.01)


@pytest.mark.slow
def test_measured_schedules_have_their_shape(two_stages):
    ranks, _ = two_stages
    gpipe, ofob = ranks[0]["gpipe"]["events"], ranks[0]["1f1b"]["events"]
    assert max_in_flight(gpipe) == [M, M]  # GPipe: all micro-batches' activations held
    assert max_in_flight(ofob) == [2, 1]  # 1F1B: at most p - s in flight
    assert text_schedule(ofob).splitlines() == ["stage 0: F0 F1 B0 F2 B1 F3 B2 B3",
                                                "stage 1: F0 B0 F1 B1 F2 B2 F3 B3"]
    for events in (gpipe, ofob):  # every stage waits at least the theoretical bubble
        assert min(measured_bubble(events)) > 0


@pytest.mark.slow
def test_stages_checkpoint_and_resume(two_stages):
    ranks, _ = two_stages
    for r in ranks:  # every stage gets its own parameters and optimizer state back
        assert r["checkpoint"]["params_equal"] and r["checkpoint"]["lr"] == pytest.approx(3e-3)
        assert r["checkpoint"]["steps"] > 0


def test_bubble_formula():
    assert P.bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert P.bubble_fraction(8, 8) == pytest.approx(7 / 15)
    assert P.bubble_fraction(1, 4) == 0.0
    assert P.bubble_fraction(4, 64) < P.bubble_fraction(4, 8)


def test_layers_split_evenly_and_need_one_per_stage():
    assert P.split_layers(2, 2) == [[0], [1]]
    assert P.split_layers(5, 2) == [[0, 1, 2], [3, 4]]
    with pytest.raises(ConfigError, match="3 pipeline stages for a model with 2 layers"):
        P.split_layers(2, 3)


def test_measured_bubble_of_a_synthetic_trace():
    # stage 0 busy 0-1 and 3-4, stage 1 busy 1-3: span 4 ms
    events = [dict(stage=0, kind="F", mb=0, t0=0, t1=1), dict(stage=1, kind="F", mb=0, t0=1, t1=2),
              dict(stage=1, kind="B", mb=0, t0=2, t1=3), dict(stage=0, kind="B", mb=0, t0=3, t1=4)]
    assert measured_bubble(events) == pytest.approx([0.5, 0.5])
    assert max_in_flight(events) == [1, 1]


def test_replay_removes_waiting_but_keeps_the_order():
    # measured: stage 1 waited 5 ms for each message; the replay starts each op when its input exists
    events = [dict(stage=0, kind="F", mb=0, t0=0, t1=1), dict(stage=1, kind="F", mb=0, t0=6, t1=7),
              dict(stage=1, kind="B", mb=0, t0=7, t1=8), dict(stage=0, kind="B", mb=0, t0=13, t1=14)]
    ideal = replay(events)
    assert [(e["stage"], e["kind"], e["t0"], e["t1"]) for e in ideal] == [
        (0, "F", 0, 1), (1, "F", 1, 2), (1, "B", 2, 3), (0, "B", 3, 4)]
    assert measured_bubble(ideal) == pytest.approx([0.5, 0.5]) and min(measured_bubble(events)) > 0.8
    with pytest.raises(ConfigError, match="missing event"):
        replay(events[1:])  # stage 1's F0 waits for a forward that never ran


def test_config_checks():
    from labkit.train.api import make_config

    with pytest.raises(ConfigError, match="at least as many micro-batches as stages"):
        make_config("pipeline-1f1b", "tiny-llama", nproc=2, microbatches=1)
    with pytest.raises(ConfigError, match="multiple of 6"):
        make_config("pipeline-gpipe", "tiny-llama", nproc=2, microbatches=3, accum=2, batch=8)
    with pytest.raises(ConfigError, match="needs at least one layer|at least one layer"):
        make_config("pipeline-gpipe", "tiny-llama", nproc=3)


@pytest.mark.slow
def test_pipeline_through_the_training_loop(tmp_path, warm_ranks):
    from labkit.viz.pipeline_schedule import plot_schedule, trace_of
    from labkit.train import run

    common = dict(profile="smoke", steps=3, out=str(tmp_path), eval_batches=1, progress=False)
    single = run("single", "tiny-llama", **common)
    record = run("pipeline-gpipe", "tiny-llama", nproc=2, stream=False, accum=2, microbatches=2, **common)
    assert record.losses == pytest.approx(single.losses, rel=1e-5)
    assert record.train.eval_loss == pytest.approx(single.train.eval_loss, rel=1e-5)
    assert sum(record.param_bytes) == single.param_bytes[0]
    assert record.trainable_params == single.trainable_params
    pipe = record.pipeline
    assert pipe.bubble_theory == pytest.approx(1 / 3) and 0 < pipe.bubble_measured < 1
    assert pipe.stage_layers == [[0], [1]] and pipe.max_in_flight == [2, 2]
    assert text_schedule(trace_of(record)).splitlines()[0] == "stage 0: F0 F1 B0 B1"
    ax = plot_schedule(record, title="gpipe")
    assert len(ax.collections) == len(trace_of(record)) == 2 * 2 * 2  # stages x (F, B) x micro-batches
    with pytest.raises(ConfigError, match="no schedule_trace"):
        trace_of(single)
