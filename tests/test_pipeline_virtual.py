"""Interleaved 1F1B and zero-bubble (ZB-V) pipelines (labkit.parallel.pipeline_virtual): the virtual-stage
split, the config checks, and one 2-rank gloo launch training both through the real loop against `single`."""
from __future__ import annotations

import pytest

from labkit.errors import ConfigError
from labkit.parallel import pipeline_virtual as V


def test_virtual_stages_split_embedding_and_head_off_a_short_model():
    assert V.split_virtual(2, 4) == [[], [0], [1], []]  # tiny-llama: embed | layer 0 | layer 1 | head
    assert V.split_virtual(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ConfigError, match="at most 4"):
        V.split_virtual(2, 6)


def test_stage_placement_loop_and_v():
    assert [V.local_stages(r, 2, "loop") for r in (0, 1)] == [[0, 2], [1, 3]]
    assert [V.local_stages(r, 2, "v") for r in (0, 1)] == [[0, 3], [1, 2]]  # first and last on rank 0
    assert [V.local_stages(r, 4, "v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_interleaving_shrinks_the_bubble_by_the_chunk_count():
    from labkit.parallel.pipeline import bubble_fraction

    assert V.interleaved_bubble(2, 4) == pytest.approx(0.5 / 4.5)
    assert V.interleaved_bubble(4, 8, chunks=1) == pytest.approx(bubble_fraction(4, 8))
    assert V.interleaved_bubble(4, 8) < bubble_fraction(4, 8)


def test_config_checks_name_the_fix():
    from labkit.train.api import make_config

    with pytest.raises(ConfigError, match="use 4"):
        make_config("pipeline-interleaved", "tiny-llama", nproc=2, microbatches=5, batch=10)
    with pytest.raises(ConfigError, match="use --nproc 2 or fewer"):
        make_config("pipeline-zero-bubble", "tiny-llama", nproc=3, microbatches=6, batch=12)
    with pytest.raises(ConfigError, match="splits a transformer"):
        make_config("pipeline-zero-bubble", "tiny-resnet", nproc=2)


@pytest.mark.slow
def test_both_schedules_match_single_through_the_training_loop(tmp_path, warm_ranks):
    from labkit.parallel.studies import run_together
    from labkit.viz.pipeline_schedule import plot_schedule, trace_of
    from labkit.train import run

    common = dict(profile="smoke", steps=3, out=str(tmp_path), eval_batches=1, progress=False)
    single = run("single", "tiny-llama", **common)
    inter, zb = run_together(["pipeline-interleaved", "pipeline-zero-bubble"], "tiny-llama", nproc=2,
                             microbatches=4, **common)
    for record, style in ((inter, "loop"), (zb, "v")):
        assert record.losses == pytest.approx(single.losses, rel=1e-5)
        assert record.train.eval_loss == pytest.approx(single.train.eval_loss, rel=1e-5)
        assert sum(record.param_bytes) == single.param_bytes[0]  # every parameter on exactly one rank
        events = trace_of(record)
        for rank in (0, 1):  # each rank ran both of its virtual stages, every micro-batch forward
            mine = [e for e in events if e["stage"] == rank]
            assert {e["chunk"] for e in mine} == set(V.local_stages(rank, 2, style))
            assert sum(e["kind"] == "F" for e in mine) == 2 * 4
    assert not any(e["kind"] == "W" for e in trace_of(inter))  # full backward
    assert sum(e["kind"] == "W" for e in trace_of(zb)) == 4 * 4  # weight gradients apart: 4 stages x 4 mb
    assert inter.pipeline.bubble_theory == pytest.approx(1 / 9) and zb.pipeline.bubble_theory == 0.0
    assert len(plot_schedule(zb).collections) == len(trace_of(zb))
