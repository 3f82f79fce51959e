"""labkit.parallel.comm: collective bytes and times, and the pipeline schedule model, on hand-computed values."""
import pytest

from labkit.errors import ConfigError
from labkit.parallel import comm


@pytest.mark.parametrize("op,n,factor,hops", [
    ("all_reduce", 4, 1.5, 6), ("all_reduce", 8, 1.75, 14), ("all_reduce", 1, 0.0, 0),
    ("all_gather", 4, 0.75, 3), ("reduce_scatter", 2, 0.5, 1), ("all_to_all", 8, 0.875, 7),
    ("broadcast", 4, 1.0, 3), ("send_recv", 2, 1.0, 1)])
def test_bytes_per_rank_and_hops_of_each_collective(op, n, factor, hops):
    assert comm.bus_factor(op, n) == pytest.approx(factor)
    assert comm.bytes_sent(op, 1000, n) == pytest.approx(1000 * factor)
    assert comm.hops(op, n) == hops


def test_all_reduce_is_a_reduce_scatter_plus_an_all_gather():
    for n in range(2, 9):
        both = comm.bytes_sent("reduce_scatter", 4096, n) + comm.bytes_sent("all_gather", 4096, n)
        assert comm.bytes_sent("all_reduce", 4096, n) == pytest.approx(both)
        assert comm.hops("all_reduce", n) == comm.hops("reduce_scatter", n) + comm.hops("all_gather", n)


def test_seconds_is_bandwidth_plus_latency_terms():
    # 100 MB all-reduced on 4 ranks at 100 GB/s: 150 MB sent -> 1.5 ms; 2 buckets x 6 hops x 10 us = 0.12 ms
    assert comm.seconds("all_reduce", 100e6, 4, 100e9) == pytest.approx(1.5e-3)
    assert comm.seconds("all_reduce", 100e6, 4, 100e9, latency_s=1e-5, messages=2) == pytest.approx(1.62e-3)
    assert comm.seconds("send_recv", 8e6, 2, 1e9, latency_s=1e-3) == pytest.approx(9e-3)


def test_the_strategies_and_the_benchmark_use_the_same_factors():
    from labkit.profiling import commbench
    from labkit.parallel.ddp import allreduce_seconds

    assert allreduce_seconds(1000, 4, 1.0)["bytes_sent_per_rank"] == pytest.approx(1500)
    for op in commbench.OPS:
        assert [commbench.bus_factor(op, n) for n in range(1, 9)] == [comm.bus_factor(op, n) for n in range(1, 9)]


@pytest.mark.parametrize("call,match", [
    (lambda: comm.bus_factor("allreduce", 4), "unknown collective 'allreduce'"),
    (lambda: comm.hops("all_gather", 0), "n=0"),
    (lambda: comm.seconds("all_gather", 1, 2, 0), "bandwidth 0"),
    (lambda: comm.bubble_fraction(0, 4), "stages=0"),
    (lambda: comm.bubble_fraction(4, 8, chunks=0), "chunks=0"),
    (lambda: comm.in_flight("zb", 4, 8), "unknown schedule 'zb'; valid schedules are: gpipe, 1f1b"),
    (lambda: comm.in_flight("1f1b", 4, 8, stage=4), "stage=4")])
def test_errors_name_the_bad_value(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_bubble_and_step_length():
    assert comm.bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert comm.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert comm.bubble_fraction(1, 8) == 0.0
    assert comm.step_slots(4, 8) == 11
    # interleaved, v = 2 chunks per stage: (3/2) / (8 + 3/2) (Narayanan et al. 2021 Sec. 2.2.2)
    assert comm.step_slots(4, 8, chunks=2) == pytest.approx(9.5)
    assert comm.bubble_fraction(4, 8, chunks=2) == pytest.approx(3 / 19)


def test_in_flight_micro_batches():
    assert comm.in_flight("gpipe", 4, 8) == 8
    assert [comm.in_flight("1f1b", 4, 8, stage=s) for s in range(4)] == [4, 3, 2, 1]
    assert comm.in_flight("1f1b", 4, 2, stage=0) == 2  # fewer micro-batches than stages


def test_stage_order_of_1f1b():
    order = [f"{k}{i}" for k, i in comm.stage_order("1f1b", 2, 4, 0)]
    assert order == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert [f"{k}{i}" for k, i in comm.stage_order("1f1b", 2, 4, 1)] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert [k for k, _ in comm.stage_order("gpipe", 3, 2, 1)] == ["F", "F", "B", "B"]


@pytest.mark.parametrize("schedule", comm.SCHEDULES)
@pytest.mark.parametrize("stages,micro", [(2, 1), (2, 4), (4, 8), (3, 7), (8, 16), (4, 2)])
def test_the_simulated_grid_agrees_with_the_formulas(schedule, stages, micro):
    grid = comm.schedule_grid(stages, micro, schedule)  # forward 1, backward 2 time units
    assert len(grid) == 2 * stages * micro
    assert comm.grid_bubble(grid) == pytest.approx(comm.bubble_fraction(stages, micro))
    assert comm.stage_bubbles(grid) == pytest.approx([comm.bubble_fraction(stages, micro)] * stages)
    # one slot = one forward + one backward = 3 units; a step is m + p - 1 slots
    assert max(e["t1"] for e in grid) == pytest.approx(3 * comm.step_slots(stages, micro))
    assert comm.max_in_flight(grid) == [comm.in_flight(schedule, stages, micro, s) for s in range(stages)]


def test_replay_keeps_the_order_and_drops_the_waiting():
    grid = comm.schedule_grid(3, 4, "1f1b")
    waited = [{**e, "t0": e["t0"] + 5 * e["stage"], "t1": e["t1"] + 5 * e["stage"]} for e in grid]
    key = lambda e: (e["stage"], e["t0"])  # noqa: E731
    assert sorted(comm.replay(waited), key=key) == sorted(grid, key=key)
    with pytest.raises(ConfigError, match="missing event"):
        comm.replay([e for e in grid if not (e["stage"] == 0 and e["kind"] == "F" and e["mb"] == 0)])


def test_events_of_a_measured_step():
    per_rank = [[("F", 0, 10.0, 10.002)], [("F", 0, 10.002, 10.003, 1)]]
    assert comm.events_of(per_rank) == [dict(stage=0, kind="F", mb=0, t0=0.0, t1=2.0),
                                        dict(stage=1, kind="F", mb=0, t0=2.0, t1=3.0, chunk=1)]


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (3, 1)])
def test_uneven_stages_give_the_formula_back_when_equal(stages, micro):
    assert comm.uneven_bubble([2.0] * stages, micro) == pytest.approx([comm.bubble_fraction(stages, micro)] * stages)


@pytest.mark.parametrize("times", [[1.0, 3.0, 2.0], [1.0, 1.5], [2.0, 1.0, 1.0, 4.0]])
def test_uneven_bubble_is_the_simulated_gpipe_with_those_stage_times(times):
    m, p = 5, len(times)  # each stage: forward t/3, backward 2t/3
    orders = {s: [(k, i, times[s] / 3 * (1 if k == "F" else 2)) for k, i in comm.stage_order("gpipe", p, m, s)]
              for s in range(p)}
    events = [dict(stage=s, kind=orders[s][j][0], mb=orders[s][j][1], t0=a, t1=b)
              for s, j, a, b in comm.run_in_order(orders)]
    assert comm.stage_times(events) == pytest.approx(times)
    assert comm.stage_bubbles(events) == pytest.approx(comm.uneven_bubble(times, m))


def test_more_micro_batches_leave_the_fast_stage_waiting():
    # The fast stage's bubble tends to 1 - t_fast / t_slow, not to 0 (notebook 07, question 7.2).
    assert comm.uneven_bubble([1.0, 2.0], 10_000)[0] == pytest.approx(0.5, abs=1e-3)
    with pytest.raises(ConfigError, match="one positive compute time per stage"):
        comm.uneven_bubble([1.0, 0.0], 4)


def test_bubble_ratio_is_the_idle_time_over_the_ideal_compute():
    # Narayanan et al. 2021 Sec. 2.2: (p - 1) / m, and (1 / v)(p - 1) / m interleaved
    assert comm.bubble_ratio(4, 8) == pytest.approx(3 / 8)
    assert comm.bubble_ratio(4, 8, chunks=2) == pytest.approx(3 / 16)
    assert comm.bubble_ratio(8, 4) == pytest.approx(7 / 4)  # not a share: more idle than compute
    for p, m, v in ((2, 4, 1), (4, 8, 2), (8, 64, 4)):  # the same idle slots, another denominator
        share, ratio = comm.bubble_fraction(p, m, v), comm.bubble_ratio(p, m, v)
        assert share == pytest.approx(ratio / (1 + ratio)) and share < ratio
    with pytest.raises(ConfigError, match="microbatches=0"):
        comm.bubble_ratio(4, 0)


def test_zero_traffic_grows_with_accumulated_micro_batches():
    assert [comm.dp_traffic_vs_ddp(s) for s in (0, 1, 2, 3)] == [1, 1, 1, 1.5]  # ZeRO paper Sec. 7, m = 1
    assert comm.dp_traffic_vs_ddp(1, 8) == 1  # one reduce-scatter and one all-gather per step
    assert comm.dp_traffic_vs_ddp(2, 8) == 4.5  # a reduce-scatter per micro-batch + the weights' gather
    assert comm.dp_traffic_vs_ddp(3, 8) == 12  # 1.5 K
    assert comm.dp_passes(3, 4, regather=True) == (12, 4)
    with pytest.raises(ConfigError, match="zero=4"):
        comm.dp_passes(4)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_the_planner_charges_the_same_passes(zero):
    from labkit.parallel import perf_dp
    from labkit.parallel.perf_model import GPUS, Layout

    def sent(z, m):
        lay = Layout(dp=8, tp=1, pp=1, micro_batch=1, microbatches=m, zero=z, checkpointing="none")
        return perf_dp.dp_time(lay, gpu=GPUS["a100-80gb"], layers=32, params_on_gpu=7e9, fwd_s=0.1, bwd_s=0.2,
                               gpus_per_node=8, inter_node_gbps=200).bytes
    for m in (1, 8):
        assert sent(zero, m) / sent(0, m) == pytest.approx(comm.dp_traffic_vs_ddp(zero, m))


def test_sequence_parallel_moves_the_same_bytes_as_tensor_parallel():
    from labkit.parallel.comm import tp_layer_bytes

    for t in (2, 4, 8):
        sp, tp = tp_layer_bytes(1e6, t, sequence_parallel=True), tp_layer_bytes(1e6, t, sequence_parallel=False)
        assert set(sp) == {"reduce_scatter", "all_gather"} and set(tp) == {"all_reduce"}
        assert sum(sp.values()) == pytest.approx(sum(tp.values())) == pytest.approx(4 * (t - 1) / t * 1e6)
