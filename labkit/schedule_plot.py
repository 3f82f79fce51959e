"""Pipeline schedules as MEASURED in a run: analysis (bubble, in-flight micro-batches) and diagrams.

A pipeline run records, per stage, when it computed which micro-batch (`RunRecord.pipeline
.schedule_trace`: dicts with stage, kind 'F'/'B', mb, t0, t1 in ms; see
`labkit.parallel.pipeline.ScheduleTrace`). `plot_schedule` draws them as the familiar GPipe / 1F1B
picture (Huang et al. 2019; Narayanan et al. 2021, Figs. 3-4): one row per stage, time to the
right, white space = the bubble. `measured_bubble` / `max_in_flight` read the idle share and the held
activations off the events, `replay` re-times them with free communication, `text_schedule` gives the
order as text, `plot_bubble` compares the measured bubble with (p - 1) / (m + p - 1).
Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

from typing import Sequence

from labkit.errors import ConfigError

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}  # W: weight-gradient half (zero bubble)


def trace_of(record) -> list[dict]:
    """The schedule events of a pipeline RunRecord (or a dict / an events list given directly)."""
    if isinstance(record, list):
        return record
    if isinstance(record, dict):  # a record's to_dict() data (schema 2 or 1) or its facts
        facts = record.get("pipeline") or record.get("extra") or record
        events = facts.get("schedule_trace")
    else:
        events = record.pipeline.schedule_trace if record.pipeline else None
    if not events:
        strategy = getattr(record, "strategy", "this record")
        raise ConfigError(f"{strategy!r} has no schedule_trace; run a pipeline strategy "
                          "(labkit train --strategy pipeline-1f1b ...) and pass its record")
    return events


def events_of(per_rank: list[list[tuple]]) -> list[dict]:
    """One step's events of every stage as dicts, times in ms from the step's first event.

    `stage` is the rank; an event with a fifth element (several stages per rank, notebook 09) also
    gets `chunk`, the virtual stage it ran."""
    start = min(e[2] for events in per_rank for e in events)
    return [dict(stage=s, kind=e[0], mb=e[1], t0=round((e[2] - start) * 1e3, 3), t1=round((e[3] - start) * 1e3, 3),
                 **({"chunk": e[4]} if len(e) > 4 else {}))
            for s, events in enumerate(per_rank) for e in events]


def measured_bubble(events: list[dict]) -> list[float]:
    """Per stage: 1 - (time computing) / (span of the whole pipeline step, first to last event)."""
    span = max(e["t1"] for e in events) - min(e["t0"] for e in events)
    stages = sorted({e["stage"] for e in events})
    busy = {s: sum(e["t1"] - e["t0"] for e in events if e["stage"] == s) for s in stages}
    return [1.0 - busy[s] / span if span > 0 else 0.0 for s in stages]


def max_in_flight(events: list[dict]) -> list[int]:
    """Per stage: the most micro-batches whose activations are held (forwarded, not yet backwarded)."""
    out = []
    for s in sorted({e["stage"] for e in events}):
        held = peak = 0
        for e in sorted((e for e in events if e["stage"] == s), key=lambda e: e["t0"]):
            held += {"F": 1, "B": -1}.get(e["kind"], 0)  # W frees no activation input
            peak = max(peak, held)
        out.append(peak)
    return out


def text_schedule(events: Sequence[dict]) -> str:
    """One line per stage: its actions in time order, e.g. 'stage 0: F0 F1 B0 F2 B1 B2'."""
    lines = []
    for s in sorted({e["stage"] for e in events}):
        ops = sorted((e for e in events if e["stage"] == s), key=lambda e: e["t0"])
        lines.append(f"stage {s}: " + " ".join(_label(e) for e in ops))
    return "\n".join(lines)


def _label(e: dict) -> str:
    """'F3', or 'F3s2' when the event ran virtual stage 2."""
    return f"{e['kind']}{e['mb']}" + (f"s{e['chunk']}" if "chunk" in e else "")


def replay(events: Sequence[dict]) -> list[dict]:
    """The same schedule with free communication: each stage keeps its measured order and op
    durations, and an op starts as soon as its stage is free and its input exists (F(s, i) needs
    F(s-1, i); B(s, i) needs B(s+1, i), the last stage's B(i) its own F(i)). Comparing the bubble of
    the replay with the measured one separates waiting for messages from the schedule's own bubble."""
    stages = sorted({e["stage"] for e in events})
    order = {s: sorted((e for e in events if e["stage"] == s), key=lambda e: e["t0"]) for s in stages}
    done: dict[tuple, float] = {}
    free = {s: 0.0 for s in stages}
    todo = {s: list(order[s]) for s in stages}
    out = []
    while any(todo.values()):
        progressed = False
        for s in stages:
            while todo[s]:
                e = todo[s][0]
                dep = (("F", s - 1, e["mb"]) if e["kind"] == "F" and s > stages[0] else
                       ("B", s + 1, e["mb"]) if e["kind"] == "B" and s < stages[-1] else
                       ("F", s, e["mb"]) if e["kind"] == "B" else None)
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done.get(dep, 0.0))
                end = start + e["t1"] - e["t0"]
                done[(e["kind"], s, e["mb"])], free[s] = end, end
                out.append({**e, "t0": round(start, 3), "t1": round(end, 3)})
                todo[s].pop(0)
                progressed = True
        if not progressed:
            raise ConfigError("the schedule trace has a cycle or a missing event; pass one complete step")
    return out


def plot_schedule(record_or_events, *, title: str | None = None, ax=None):
    """Gantt chart of one measured pipeline step; returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    events = trace_of(record_or_events)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.7 * len({e["stage"] for e in events})))
    stages = sorted({e["stage"] for e in events})
    for e in events:
        width = e["t1"] - e["t0"]
        ax.broken_barh([(e["t0"], width)], (e["stage"] - 0.4, 0.8), facecolors=COLORS[e["kind"]],
                       edgecolors="white", linewidth=0.5)
        ax.text(e["t0"] + width / 2, e["stage"], _label(e), ha="center", va="center",
                color="white", fontsize=8, clip_on=True)
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("time in the step (ms)")
    kinds = [k for k in COLORS if any(e["kind"] == k for e in events)]
    names = {"F": "forward", "B": "backward" if "W" not in kinds else "backward (input)", "W": "backward (weights)"}
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds]
    ax.legend(handles, [names[k] for k in kinds], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if title:
        ax.set_title(title)
    return ax


def plot_bubble(rows: Sequence[dict], *, ax=None):
    """Measured vs theoretical bubble over micro-batch counts.

    rows: dicts with 'schedule', 'microbatches', 'stages', 'bubble_measured' (one per run)."""
    import matplotlib.pyplot as plt

    from labkit.parallel.pipeline import bubble_fraction

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    for schedule in sorted({r["schedule"] for r in rows}):
        mine = sorted((r for r in rows if r["schedule"] == schedule), key=lambda r: r["microbatches"])
        ax.plot([r["microbatches"] for r in mine], [r["bubble_measured"] for r in mine], "o-",
                label=f"{schedule} measured")
    stages = rows[0]["stages"] if rows else 2
    ms = sorted({r["microbatches"] for r in rows}) or [1]
    grid = range(1, max(ms) + 1)
    ax.plot(list(grid), [bubble_fraction(stages, m) for m in grid], "k--", label=f"(p-1)/(m+p-1), p={stages}")
    ax.set(xlabel="micro-batches m", ylabel="idle share of a stage", ylim=(0, 1), title="pipeline bubble")
    ax.legend(fontsize=8)
    return ax
