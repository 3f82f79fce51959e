"""labkit.viz.figures, collectives and simulated_schedule: the tables behind the lecture figures agree with the
papers and with labkit's other models (pipeline bubble, schedule_plot, memory estimate, planner); every figure
draws headless."""
from __future__ import annotations

import dataclasses
import math
import random

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit.parallel import comm  # noqa: E402
from labkit.viz import collectives  # noqa: E402
from labkit.viz import figures as F  # noqa: E402
from labkit.viz import simulated_schedule as sim  # noqa: E402
from labkit.errors import ConfigError  # noqa: E402


def _texts(fig) -> str:
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts + [ax.title]) + (
        fig._suptitle.get_text() if fig._suptitle else "")


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_ring_allreduce_sums_everywhere_and_each_rank_sends_2_n_minus_1_chunks(n):
    rng = random.Random(n)
    values = [[rng.randint(-50, 50) for _ in range(n)] for _ in range(n)]
    final, history = collectives.simulate_ring_allreduce(values)
    column_sums = [sum(values[r][c] for r in range(n)) for c in range(n)]
    assert all(row == column_sums for row in final)
    plan = collectives.ring_allreduce_plan(n)
    assert len(plan) == 2 * (n - 1)
    for rank in range(n):  # 2 (N-1) chunks of S/N: 2 (N-1)/N x S per rank, to the right neighbour only
        sends = [(dst, c) for step in plan for src, dst, c in step["sends"] if src == rank]
        assert len(sends) == 2 * (n - 1) and {dst for dst, _ in sends} == {(rank + 1) % n}
    # after the reduce-scatter half, rank r owns the complete sum of chunk r + 1
    after_rs = history[n - 1]
    assert all(after_rs[r][(r + 1) % n] == frozenset(range(n)) for r in range(n))
    assert all(cell == frozenset(range(n)) for row in history[-1] for cell in row)


def test_ring_rejects_a_ragged_buffer():
    with pytest.raises(ConfigError, match="n x n"):
        collectives.simulate_ring_allreduce([[1.0, 2.0], [3.0]])


@pytest.mark.parametrize("schedule", sim.SCHEDULE_NAMES)
@pytest.mark.parametrize("stages,micro", [(2, 1), (2, 4), (4, 8), (3, 7), (8, 16), (4, 2)])
def test_pipeline_table_bubble_matches_the_formula_and_respects_dependencies(schedule, stages, micro):
    from labkit.parallel.pipeline import bubble_fraction

    table = sim.pipeline_table(stages, micro, schedule)
    assert len(table) == 2 * stages * micro
    assert sim.table_bubble(table) == pytest.approx(bubble_fraction(stages, micro))
    end = {(op.kind, op.stage, op.micro): op.end for op in table}
    for op in table:
        if op.kind == "F" and op.stage > 0:
            assert op.start >= end[("F", op.stage - 1, op.micro)]
        if op.kind == "B":
            assert op.start >= end[("F", op.stage, op.micro)]
            if op.stage < stages - 1:
                assert op.start >= end[("B", op.stage + 1, op.micro)]
    for s in range(stages):  # a stage runs one op at a time
        mine = [op for op in table if op.stage == s]
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))
        expected = micro if schedule == "gpipe" else min(stages - s, micro)
        assert sim.in_flight(table, s) == expected  # GPipe holds m, 1F1B at most p - s (Narayanan 2021)


def test_pipeline_table_agrees_with_schedule_plot():
    from labkit.viz.pipeline_schedule import max_in_flight, measured_bubble, replay

    table = sim.pipeline_table(4, 8, "1f1b")
    events = sim.schedule_events(table)
    assert measured_bubble(events) == pytest.approx([sim.table_bubble(table)] * 4)
    assert max_in_flight(events) == [4, 3, 2, 1]
    key = lambda e: (e["stage"], e["t0"])  # noqa: E731
    assert sorted(replay(events), key=key) == sorted(events, key=key)


def test_pipeline_rejects_unknown_schedule():
    with pytest.raises(ConfigError, match="interleaved.*gpipe, 1f1b"):
        sim.pipeline_table(4, 8, "interleaved")


def test_checkpointing_memory_is_minimal_near_sqrt_n():
    for n in (16, 36, 100):
        best = min(range(1, n + 1), key=lambda k: F.checkpoint_memory(n, k))
        assert abs(best - math.sqrt(n)) <= 1
        assert F.checkpoint_memory(n, best) == 2 * math.isqrt(n)  # 2 sqrt(n) for a perfect square
        assert F.checkpoint_memory(n, n) == n + 1  # every layer a segment: no saving
    with pytest.raises(ConfigError, match="segments=9 > layers=8"):
        F.checkpoint_memory(8, 9)


def test_zero_partitioning_labels_the_zero_papers_figure_1():
    fig = F.zero_partitioning(4, params=7_500_000_000, dp=64)
    text = _texts(fig)
    for gb in ("120.0 GB", "31.4 GB", "16.6 GB", "1.9 GB"):  # Rajbhandari et al. 2020, Fig. 1
        assert gb in text
    plt.close(fig)


def test_parallel_layout_places_tp_groups_inside_nodes_and_checks_the_product():
    fig = F.parallel_layout(dp=2, tp=8, pp=4)
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert len(labels) == 64 and labels[0] == "s0 d0\nt0" and labels[8] == "s0 d1\nt0" and labels[16] == "s1 d0\nt0"
    assert "inside a node" in fig.axes[0].get_title()
    plt.close(fig)
    crossing = F.parallel_layout(dp=1, tp=16, pp=1)
    assert "crosses nodes" in crossing.axes[0].get_title()
    plt.close(crossing)
    with pytest.raises(ConfigError, match=r"= 512 != gpus\(64\)"):
        F.parallel_layout(dp=8, tp=8, pp=8, gpus=64)


def test_lora_update_counts_r_times_d_plus_k():
    fig = F.lora_update(d=4096, k=4096, r=8)
    assert "65,536" in _texts(fig) and "0.39%" in _texts(fig)
    plt.close(fig)


def test_plan_chart_draws_the_planners_best_layouts():
    from labkit.parallel import planner

    fig = F.plan_chart("gpt3-175b", 64, 8, top=5)
    best = planner.plan(planner.PlanRequest(model="gpt3-175b", gpus=64, gpus_per_node=8)).fits[:5]
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert ticks == [f"dp{o.dp} tp{o.tp} pp{o.pp} z{o.zero} m{o.microbatches}" for o in best]
    plt.close(fig)


@pytest.mark.parametrize("draw", [
    lambda: collectives.ring_allreduce_steps(3), lambda: collectives.allreduce_traffic(16),
    F.checkpointing_tradeoff, lambda: sim.pipeline_schedule(3, 4), lambda: F.tensor_split(4)])
def test_figures_draw_headless(draw, tmp_path):
    fig = draw()
    fig.savefig(tmp_path / "f.png", dpi=40)
    assert (tmp_path / "f.png").stat().st_size > 1000 and fig.axes
    plt.close(fig)


@pytest.mark.parametrize("call,match", [
    (lambda: collectives.ring_allreduce_steps(1), "n >= 2"), (lambda: F.tensor_split(9), "tp=9"),
    (lambda: sim.pipeline_table(0, 4), "stages=0"), (lambda: F.zero_partitioning(gpus=0), "gpus=0")])
def test_bad_arguments_name_the_value(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_the_exercise_grid_counts_slots_and_leaves_the_answer_out():
    fig = sim.pipeline_schedule(4, 4, "gpipe", backward=1.0, answer=False)
    ax = fig.axes[0]
    assert ax.get_title() == "GPipe: p = 4, m = 4" and "holds" not in " ".join(t.get_text() for t in ax.texts)
    assert list(ax.get_xticks()) == list(range(15))  # 2 (m + p - 1) = 14 one-slot columns
    assert "bubble" in sim.pipeline_schedule(4, 4, "gpipe").axes[0].get_title()
    plt.close("all")


def _ladder_run(ranks: int, step_s: float, cpu_s: list[float]):
    from labkit.facts import TrainFacts
    from labkit.results import RunRecord

    return RunRecord(strategy="ddp", model="tiny-resnet", profile="smoke", world_size=ranks, steps=8, losses=[1.0],
                     step_time_s=step_s, samples_per_s=16 / step_s, peak_bytes=[1] * ranks, param_bytes=[1] * ranks,
                     grad_bytes=[1] * ranks, optimizer_bytes=[1] * ranks, trainable_params=1, device="cpu",
                     dtype="float32", global_batch=16, train=TrainFacts(cpu_step_time_s=cpu_s))


def test_an_efficiency_above_one_is_flagged_with_its_cause():
    from labkit.viz import report

    busy_baseline = [_ladder_run(1, 2.0, [0.4]), _ladder_run(2, 0.4, [0.25, 0.25])]
    rows = report.scaling_rows(busy_baseline)
    assert rows[1]["efficiency"] == 2.5 and rows[0]["cpu_ms"] == 400.0 and rows[1]["cpu_share"] == 0.62
    notes = report.scaling_notes(busy_baseline)
    assert any("computed only 20%" in n for n in notes)  # the baseline had a fifth of a core
    assert any("efficiency 2.50 > 1" in n and "CPU contention" in n for n in notes)
    cache = report.scaling_notes([_ladder_run(1, 1.0, [1.0]), _ladder_run(2, 0.4, [0.4, 0.4])])
    assert any("cache effects" in n for n in cache)
    assert report.scaling_notes([_ladder_run(1, 1.0, [1.0]), _ladder_run(2, 0.6, [0.6, 0.6])]) == []
    fig = report.scaling_chart(busy_baseline)
    assert any("above ideal" in t.get_text() for t in fig.axes[0].get_legend().get_texts())
    plt.close(fig)


def test_bubble_rows_put_theory_stage_times_and_measurement_side_by_side():
    from labkit.facts import PipelineFacts
    from labkit.viz.pipeline_schedule import bubble_rows

    m, times = 4, [1.0, 2.0]  # stage 1 (the LM head) twice as slow; no waiting for messages
    orders = {s: [(k, i, times[s] / 3 * (1 if k == "F" else 2)) for k, i in comm.stage_order("1f1b", 2, m, s)]
              for s in range(2)}
    events = [dict(stage=s, kind=orders[s][j][0], mb=orders[s][j][1], t0=a, t1=b)
              for s, j, a, b in comm.run_in_order(orders)]
    rec = dataclasses.replace(_ladder_run(2, 1.0, [1.0, 1.0]), pipeline=PipelineFacts(
        pp=2, schedule="1f1b", microbatches=m, bubble_theory=comm.bubble_fraction(2, m), bubble_measured=0.5,
        max_in_flight=[2, 1], schedule_trace=events))
    (row,) = bubble_rows([rec])
    assert row["stage_ms"] == [1.0, 2.0] and row["bubble_theory"] == 0.2
    assert row["bubble_uneven"] == round(sum(comm.uneven_bubble(times, m)) / 2, 3) > row["bubble_theory"]
    assert row["bubble_free_comm"] == pytest.approx(row["bubble_uneven"], abs=0.05) and row["bubble_measured"] == 0.5
    steady = dataclasses.replace(rec, pipeline=dataclasses.replace(rec.pipeline, stage_ms=[3.0, 3.0]))
    assert bubble_rows([steady])[0]["stage_ms"] == [3.0, 3.0]  # the median over steps wins over the last step


def test_schedule_facts_keep_the_median_stage_times():
    from labkit.parallel.pipeline_trace import schedule_facts

    def step(slow: float):  # rank 0: one F and one B of 1 ms; rank 1 of `slow` ms; (kind, mb, t0, t1) in seconds
        return [[("F", 0, 0.0, 0.001), ("B", 0, 0.002, 0.003)],
                [("F", 0, 0.0, slow / 1e3), ("B", 0, 0.01, 0.01 + slow / 1e3)]]

    steps = [step(9.0), step(9.0), step(2.0), step(50.0), step(2.0)]  # two warm-up steps, one preempted step
    facts = schedule_facts([[s[r] for s in steps] for r in range(2)], stages=2, microbatches=1, skip=2)
    assert facts["stage_ms"] == [2.0, 4.0]
