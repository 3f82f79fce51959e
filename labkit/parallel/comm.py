"""What communication and pipelining cost: THE one place these formulas live (pure Python, no torch).

Collectives on n ranks, ring algorithms (Patarasuk & Yuan 2009). The payload S is the buffer as
nccl-tests counts it (doc/PERFORMANCE.md): the tensor all-reduced or broadcast, the gathered OUTPUT
of an all-gather, the INPUT of a reduce-scatter, each rank's send buffer of an all-to-all, the
message of a send/recv. Each rank then sends, in `hops` messages:

  collective      bytes sent per rank   hops      why
  all_reduce      2 (n-1)/n x S         2 (n-1)   a reduce-scatter, then an all-gather of the sums
  all_gather        (n-1)/n x S           n-1     passes on the n-1 chunks of S/n it does not own
  reduce_scatter    (n-1)/n x S           n-1     adds one chunk of S/n per hop, passes it on
  all_to_all        (n-1)/n x S           n-1     keeps its own 1/n of the buffer, sends the rest
  broadcast                   S           n-1     pipelined: every byte crosses every link once
  send_recv                   S             1     point to point, one message (pipeline stages)

The per-rank factor is nccl-tests' bus-bandwidth factor (busbw = algbw x factor): the ring is
bandwidth-optimal, so bytes / link bandwidth is the time, nearly independent of n. Time is the
alpha-beta model: seconds = bytes sent / bandwidth + messages x hops x latency.

Pipelines with a flush (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2021 Sec. 2.2): p stages,
m micro-batches per step, v model chunks per stage (interleaved, Sec. 2.2.2). Every stage idles
(p - 1) / v micro-batch slots while the pipeline fills and drains, so a step takes m + (p - 1) / v
slots and the bubble is ((p - 1) / v) / (m + (p - 1) / v); (p - 1) / (m + p - 1) for v = 1, GPipe
and 1F1B alike (`bubble_ratio` gives the same idle time over the ideal compute instead, (p - 1) / m, as
Narayanan et al. write it). They differ in memory: GPipe's stages hold all m micro-batches' activations at the
peak, 1F1B's stage s at most p - s (it warms up with p - s - 1 forwards, then alternates).
`schedule_grid` simulates the step op by op; its idle share (`stage_bubbles`) and peak held
micro-batches (`max_in_flight`) are the formulas above, and the same functions read a MEASURED
schedule (`events_of` a run's `ScheduleTrace`, `labkit.parallel.pipeline`).
Introduced in notebooks 03_ddp (ring), 05_zero (`dp_passes`: ZeRO traffic per step) and 07_model_parallel
(pipelines).
"""
from __future__ import annotations

import numbers
from typing import Sequence

from labkit.errors import ConfigError, choices_error

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
SCHEDULES = ("gpipe", "1f1b")


def _positive(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ConfigError(f"{name}={value!r}; it must be a positive integer")


def _collective(op: str, n: int) -> None:
    if op not in COLLECTIVES:
        raise choices_error("collective", op, COLLECTIVES)
    _positive(n=n)


# ----------------------------------------------------------------------------- collectives
def bus_factor(op: str, n: int) -> float:
    """Bytes each rank sends per byte of payload S (the table in the module docstring)."""
    _collective(op, n)
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("broadcast", "send_recv"):
        return 1.0
    return (n - 1) / n


def hops(op: str, n: int) -> int:
    """Messages in a row each rank sends: what the latency term multiplies (a collective on one rank: 0)."""
    _collective(op, n)
    if op == "send_recv":
        return 1
    return 2 * (n - 1) if op == "all_reduce" else n - 1


def bytes_sent(op: str, payload: float, n: int) -> float:
    """Bytes each of the n ranks sends for one `op` over `payload` bytes (S, module docstring)."""
    return bus_factor(op, n) * payload


def seconds(op: str, payload: float, n: int, bandwidth_bytes_s: float, *, latency_s: float = 0.0,
            messages: int = 1) -> float:
    """Time of `messages` back-to-back `op`s that together move `payload` bytes: the bandwidth term
    plus the latency of each message's hops (DDP's ~25 MiB buckets are such messages)."""
    if bandwidth_bytes_s <= 0:
        raise ConfigError(f"bandwidth {bandwidth_bytes_s!r} B/s; it must be positive (e.g. 100e9 for NVLink)")
    return bytes_sent(op, payload, n) / bandwidth_bytes_s + messages * hops(op, n) * latency_s


# ----------------------------------------------------------------------------- pipeline schedule
def warmup_slots(stages: int, chunks: int = 1) -> float:
    """Micro-batch slots each stage idles per step while the pipeline fills and drains: (p - 1) / v."""
    _positive(stages=stages, chunks=chunks)
    return (stages - 1) / chunks


def step_slots(stages: int, microbatches: int, chunks: int = 1) -> float:
    """Length of one step in micro-batch slots (one forward + backward of a micro-batch on a stage)."""
    _positive(microbatches=microbatches)
    return microbatches + warmup_slots(stages, chunks)


def bubble_fraction(stages: int, microbatches: int, chunks: int = 1) -> float:
    """Idle share of each stage: (p - 1) / (m + p - 1), or ((p-1)/v) / (m + (p-1)/v) interleaved."""
    return warmup_slots(stages, chunks) / step_slots(stages, microbatches, chunks)


def bubble_ratio(stages: int, microbatches: int, chunks: int = 1) -> float:
    """The bubble over the ideal compute time: (p - 1) / m, or (1 / v)(p - 1) / m interleaved.

    The form Narayanan et al. 2021 (Sec. 2.2.1-2.2.2) and the Ultra-Scale Playbook write; `bubble_fraction`
    is the same idle time as a share of the whole step (always < 1; this ratio is not bounded by 1)."""
    _positive(microbatches=microbatches)
    return warmup_slots(stages, chunks) / microbatches


# ----------------------------------------------------------------------------- data parallelism
def dp_passes(zero: int, microbatches: int = 1, *, regather: bool = False) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of each layer's bf16 weights / gradients per optimizer step.

    DDP's all-reduce counts as one of each (a reduce-scatter, then an all-gather of the sums), once per
    step (`no_sync` for the first m - 1 micro-batches). ZeRO-1 too (reduce-scatter, then an all-gather of
    the updated weights). ZeRO-2 keeps gradients sharded, so every micro-batch reduce-scatters (m); ZeRO-3
    / FULL_SHARD gathers before each forward and backward and reduce-scatters every micro-batch (3m; 4m
    with DeepSpeed's re-gather for a recomputed forward). Keeping unsharded gradients across the
    accumulation (FSDP2 `set_requires_gradient_sync(False)`, `no_sync`) brings the reduce-scatters back
    to one per step, for the memory of full gradients. Rajbhandari et al. 2020 Sec. 7 count m = 1."""
    _positive(microbatches=microbatches)
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"zero={zero!r}; ZeRO stages are 0, 1, 2 and 3")
    m = microbatches
    return {0: (1, 1), 1: (1, 1), 2: (1, m), 3: ((3 if regather else 2) * m, m)}[zero]


def dp_traffic_vs_ddp(zero: int, microbatches: int = 1, *, regather: bool = False) -> float:
    """Bytes a rank sends per step for data parallelism, over DDP's (same-size weights and gradients).

    1 for ZeRO-1; (m + 1) / 2 for ZeRO-2 and 1.5 m for ZeRO-3 with m accumulated micro-batches: "stages
    1-2 cost no extra communication" and "ZeRO-3 is 1.5x" hold for m = 1 only."""
    return sum(dp_passes(zero, microbatches, regather=regather)) / sum(dp_passes(0))


def in_flight(schedule: str, stages: int, microbatches: int, stage: int = 0) -> int:
    """Most micro-batches whose activations `stage` holds at once: the activation-memory factor."""
    _check_schedule(schedule, stages, microbatches)
    if not 0 <= stage < stages:
        raise ConfigError(f"stage={stage!r}; a pipeline of {stages} stages has stages 0 to {stages - 1}")
    return microbatches if schedule == "gpipe" else min(stages - stage, microbatches)


def _check_schedule(schedule: str, stages: int, microbatches: int) -> None:
    _positive(stages=stages, microbatches=microbatches)
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown schedule {schedule!r}; valid schedules are: {', '.join(SCHEDULES)}")


def stage_order(schedule: str, stages: int, microbatches: int, stage: int) -> list[tuple[str, int]]:
    """The ops stage `stage` runs, in order: ('F', i) forward / ('B', i) backward of micro-batch i."""
    _check_schedule(schedule, stages, microbatches)
    if schedule == "gpipe":  # Huang et al. 2019: all forwards, then all backwards
        return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
    # 1F1B / PipeDream-Flush (Narayanan et al. 2021, Sec. 2.2): p - s - 1 warm-up forwards,
    # then one forward + one backward, then the remaining backwards.
    warm = min(stages - stage - 1, microbatches)
    ops, f = [("F", i) for i in range(warm)], warm
    for b in range(microbatches):
        if f < microbatches:
            ops.append(("F", f))
            f += 1
        ops.append(("B", b))
    return ops


def run_in_order(orders: dict[int, Sequence[tuple[str, int, float]]]) -> list[tuple[int, int, float, float]]:
    """Time each stage's ops (kind, micro-batch, duration) in their order: an op starts when its stage
    is free and its input exists (F(s, i) needs F(s-1, i); B(s, i) needs B(s+1, i), the last stage's
    B(i) its own F(i); other kinds, e.g. W, need nothing). Returns (stage, index in its order,
    start, end) in the order the ops ran; raises if an input never comes."""
    stages = sorted(orders)
    done: dict[tuple, float] = {}
    free = {s: 0.0 for s in stages}
    pos = {s: 0 for s in stages}
    out = []
    while any(pos[s] < len(orders[s]) for s in stages):
        progressed = False
        for s in stages:
            while pos[s] < len(orders[s]):
                kind, mb, duration = orders[s][pos[s]]
                dep = (("F", s - 1, mb) if kind == "F" and s > stages[0] else
                       ("B", s + 1, mb) if kind == "B" and s < stages[-1] else
                       ("F", s, mb) if kind == "B" else None)
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done.get(dep, 0.0))
                done[(kind, s, mb)] = free[s] = start + duration
                out.append((s, pos[s], start, start + duration))
                pos[s] += 1
                progressed = True
        if not progressed:
            raise ConfigError("the schedule has a cycle or a missing event; pass one complete step")
    return out


def schedule_grid(stages: int, microbatches: int, schedule: str = "1f1b", *, forward: float = 1.0,
                  backward: float = 2.0) -> list[dict]:
    """One step of `schedule` simulated op by op (communication free): events (stage, kind, mb, t0,
    t1) in time units, sorted by stage and start -- the grid the course's schedule figures draw."""
    _check_schedule(schedule, stages, microbatches)
    orders = {s: stage_order(schedule, stages, microbatches, s) for s in range(stages)}
    timed = run_in_order({s: [(k, i, forward if k == "F" else backward) for k, i in ops]
                          for s, ops in orders.items()})
    events = [dict(stage=s, kind=orders[s][j][0], mb=orders[s][j][1], t0=t0, t1=t1) for s, j, t0, t1 in timed]
    return sorted(events, key=lambda e: (e["stage"], e["t0"]))


def replay(events: Sequence[dict]) -> list[dict]:
    """A measured step re-timed with free communication: each stage keeps its measured order and op
    durations (`run_in_order`). Comparing its bubble with the measured one separates waiting for
    messages from the schedule's own bubble. Times rounded to the microsecond, as measured."""
    stages = sorted({e["stage"] for e in events})
    order = {s: sorted((e for e in events if e["stage"] == s), key=lambda e: e["t0"]) for s in stages}
    timed = run_in_order({s: [(e["kind"], e["mb"], e["t1"] - e["t0"]) for e in ops] for s, ops in order.items()})
    return [{**order[s][j], "t0": round(t0, 3), "t1": round(t1, 3)} for s, j, t0, t1 in timed]


def events_of(per_rank: list[list[tuple]]) -> list[dict]:
    """One measured step's events of every stage as dicts, times in ms from the step's first event.

    `stage` is the rank; an event with a fifth element (several stages per rank, notebook 09) also
    gets `chunk`, the virtual stage it ran."""
    start = min(e[2] for events in per_rank for e in events)
    return [dict(stage=s, kind=e[0], mb=e[1], t0=round((e[2] - start) * 1e3, 3), t1=round((e[3] - start) * 1e3, 3),
                 **({"chunk": e[4]} if len(e) > 4 else {}))
            for s, events in enumerate(per_rank) for e in events]


def _busy(events: Sequence[dict]) -> tuple[float, dict]:
    """(span of the whole step, first to last event; time computing per stage)."""
    span = max(e["t1"] for e in events) - min(e["t0"] for e in events)
    stages = sorted({e["stage"] for e in events})
    return span, {s: sum(e["t1"] - e["t0"] for e in events if e["stage"] == s) for s in stages}


def stage_bubbles(events: Sequence[dict]) -> list[float]:
    """Per stage: 1 - (time computing) / (span of the whole step)."""
    span, busy = _busy(events)
    return [1.0 - b / span if span > 0 else 0.0 for b in busy.values()]


def stage_times(events: Sequence[dict]) -> list[float]:
    """Per stage: its compute time per micro-batch (busy time / micro-batches it ran), in the events'
    unit -- how even the stages are. A stage of a real model is rarely average: the first also embeds
    the tokens, the last also runs the LM head and the loss."""
    _, busy = _busy(events)
    return [b / len({e["mb"] for e in events if e["stage"] == s}) for s, b in busy.items()]


def uneven_bubble(times: Sequence[float], microbatches: int) -> list[float]:
    """Per stage: the idle share of a flush pipeline whose stage s computes `times[s]` per micro-batch
    (forward + backward), communication free. Every micro-batch passes every stage once and the
    slowest stage paces the rest (a flow shop), so a step lasts sum(t) + (m - 1) max(t), of which
    stage s computes m t_s: bubble_s = 1 - m t_s / (sum(t) + (m - 1) max(t)). Equal stages give
    (p - 1) / (m + p - 1); uneven ones idle more, the fastest stage most -- and more micro-batches no
    longer drive the bubble to 0 but to 1 - t_s / max(t). Exact for GPipe when each stage's backward
    is a fixed multiple of its forward; 1F1B runs the same ops in another order, with the same span
    for equal stages and close to it for uneven ones."""
    _positive(microbatches=microbatches)
    if not times or min(times) <= 0:
        raise ConfigError(f"times={list(times)!r}: give one positive compute time per stage")
    span = sum(times) + (microbatches - 1) * max(times)
    return [1 - microbatches * t / span for t in times]


def grid_bubble(events: Sequence[dict]) -> float:
    """The step's bubble, averaged over the stages: 1 - busy / (span x stages)."""
    span, busy = _busy(events)
    return 1 - sum(busy.values()) / (span * len(busy)) if span > 0 else 0.0


def max_in_flight(events: Sequence[dict]) -> list[int]:
    """Per stage: the most micro-batches whose activations are held (forwarded, not yet backwarded)."""
    out = []
    for s in sorted({e["stage"] for e in events}):
        held = peak = 0
        for e in sorted((e for e in events if e["stage"] == s), key=lambda e: e["t0"]):
            held += {"F": 1, "B": -1}.get(e["kind"], 0)  # W frees no activation input
            peak = max(peak, held)
        out.append(peak)
    return out


# ----------------------------------------------------------------------------- tensor / sequence parallelism
def tp_layer_bytes(activation_bytes: float, tp: int, *, sequence_parallel: bool) -> dict[str, float]:
    """Bytes each rank sends in one transformer layer's FORWARD under Megatron TP, by collective: two
    all-reduces of the (B, T, H) activation (after o_proj and down_proj), or with sequence parallelism two
    reduce-scatters + two all-gathers of it (Korthikanti et al. 2022, Sec. 4.2.2). An all-reduce is a
    reduce-scatter then an all-gather, so the totals are equal: 4 (t-1)/t S either way. The backward
    mirrors the forward (`labkit.parallel.sequence`, notebook 07_model_parallel)."""
    if sequence_parallel:
        return {"reduce_scatter": 2 * bytes_sent("reduce_scatter", activation_bytes, tp),
                "all_gather": 2 * bytes_sent("all_gather", activation_bytes, tp)}
    return {"all_reduce": 2 * bytes_sent("all_reduce", activation_bytes, tp)}
