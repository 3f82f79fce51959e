"""Pipeline schedules as MEASURED in a run: analysis (bubble, in-flight micro-batches) and diagrams.

A pipeline run records, per stage, when it computed which micro-batch (`RunRecord.pipeline
.schedule_trace`: dicts with stage, kind 'F'/'B', mb, t0, t1 in ms; see
`labkit.parallel.pipeline_trace.ScheduleTrace`). `plot_schedule` draws them as the familiar GPipe / 1F1B
picture (Huang et al. 2019; Narayanan et al. 2021, Figs. 3-4): one row per stage, time to the
right, white space = the bubble. The schedule model that reads the events lives in
`labkit.parallel.comm` and is re-exported here for the notebooks: `measured_bubble` / `max_in_flight`
read the idle share and the held activations off the events, `replay` re-times them with free
communication. `text_schedule` gives the order as text; `bubble_rows` puts each run's measured bubble
beside the theory of equal stages, the uneven-stage model of its measured stage times and the replay,
and `plot_bubble` draws them over the micro-batch counts.
Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

from typing import Sequence

from labkit.errors import ConfigError
from labkit.parallel.comm import bubble_fraction, events_of, max_in_flight, replay  # noqa: F401 (re-exported)
from labkit.parallel.comm import stage_bubbles as measured_bubble  # noqa: F401 (re-exported)
from labkit.parallel.comm import stage_times, uneven_bubble

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


def bubble_rows(records) -> list[dict]:
    """One row per pipeline RunRecord, from the bubble of the theory to the measured one:

    - `stage_ms`: each stage's compute time per micro-batch, median over the steps after warm-up (the last
      step's for a record without it): how uneven the stages are;
    - `bubble_theory`: (p - 1) / (m + p - 1), equal stages and free communication;
    - `bubble_uneven`: the same flush schedule with the measured stage times (`comm.uneven_bubble`);
    - `bubble_free_comm`: the last step's measured operations re-timed with free messages (`replay`);
    - `bubble_measured`: the median idle share over the steps after warm-up, messages included.
    Bubbles are means over the stages."""
    rows = []
    for rec in records:
        pipe, events = rec.pipeline, trace_of(rec)
        times = list(pipe.stage_ms) or stage_times(events)
        rows.append(dict(schedule=pipe.schedule, stages=pipe.pp, microbatches=pipe.microbatches,
                         stage_ms=[round(t, 3) for t in times], bubble_theory=round(pipe.bubble_theory, 3),
                         bubble_uneven=round(_mean(uneven_bubble(times, pipe.microbatches)), 3),
                         bubble_free_comm=round(_mean(measured_bubble(replay(events))), 3),
                         bubble_measured=round(pipe.bubble_measured, 3), max_in_flight=pipe.max_in_flight,
                         peak_KiB=[round(b / 1024) for b in rec.peak_bytes]))
    return rows


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def plot_bubble(rows: Sequence[dict], *, ax=None):
    """Measured vs theoretical bubble over micro-batch counts.

    rows: dicts with 'schedule', 'microbatches', 'stages', 'bubble_measured' (one per run), and
    optionally 'bubble_uneven' / 'bubble_free_comm' (`bubble_rows`), drawn as open markers."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    for i, schedule in enumerate(sorted({r["schedule"] for r in rows})):
        mine = sorted((r for r in rows if r["schedule"] == schedule), key=lambda r: r["microbatches"])
        ms = [r["microbatches"] for r in mine]
        ax.plot(ms, [r["bubble_measured"] for r in mine], "o-", color=f"C{i}", label=f"{schedule} measured")
        for key, marker, what in (("bubble_free_comm", "s", "free communication"),
                                  ("bubble_uneven", "^", "uneven-stage model")):
            if all(key in r for r in mine):
                ax.plot(ms, [r[key] for r in mine], marker, mfc="none", color=f"C{i}", linestyle=":",
                        label=f"{schedule} {what}")
    stages = rows[0]["stages"] if rows else 2
    ms = sorted({r["microbatches"] for r in rows}) or [1]
    grid = range(1, max(ms) + 1)
    ax.plot(list(grid), [bubble_fraction(stages, m) for m in grid], "k--", label=f"(p-1)/(m+p-1), p={stages}")
    ax.set(xlabel="micro-batches m", ylabel="idle share of a stage", ylim=(0, 1), title="pipeline bubble")
    ax.legend(fontsize=8)
    return ax
