"""Pipeline schedules as SIMULATED from their dependencies, for the lecture and notebook 07: GPipe and 1F1B
flush schedules (`pipeline_table`, from `labkit.parallel.comm.schedule_grid`), their bubble
(p - 1)/(m + p - 1) and held micro-batches (Huang et al. 2019; Narayanan et al. 2021), and
`pipeline_schedule`, which draws them with `labkit.viz.pipeline_schedule.plot_schedule`, the function
notebook 07 uses for the MEASURED schedule, so lecture and lab show the same picture.
Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.parallel import comm


SCHEDULE_NAMES = comm.SCHEDULES


@dataclass(frozen=True)
class PipeOp:
    """One forward ('F') or backward ('B') of micro-batch `micro` on `stage`, in forward-time units."""

    stage: int
    kind: str
    micro: int
    start: float
    end: float


def pipeline_table(stages: int, microbatches: int, schedule: str = "1f1b", *, forward: float = 1.0,
                   backward: float = 2.0) -> list[PipeOp]:
    """The flush pipeline `labkit.parallel.comm.schedule_grid` simulates, as PipeOps: each stage runs its
    schedule's op order, an op starting when the stage is free and its input has arrived."""
    grid = comm.schedule_grid(stages, microbatches, schedule, forward=forward, backward=backward)
    return [PipeOp(e["stage"], e["kind"], e["mb"], e["t0"], e["t1"]) for e in grid]


def table_bubble(table: list[PipeOp]) -> float:
    """Idle share of the step, averaged over stages: 1 - busy / span."""
    return comm.grid_bubble(schedule_events(table))


def in_flight(table: list[PipeOp], stage: int) -> int:
    """Peak number of micro-batches whose activations `stage` holds (forward done, backward not)."""
    return comm.max_in_flight([e for e in schedule_events(table) if e["stage"] == stage])[0]


def schedule_events(table: list[PipeOp]) -> list[dict]:
    """The table as `labkit.viz.pipeline_schedule` events (stage, kind, mb, t0, t1), the layout of a measured run."""
    return [dict(stage=op.stage, kind=op.kind, mb=op.micro, t0=op.start, t1=op.end) for op in table]


def pipeline_schedule(stages: int = 4, microbatches: int = 8, schedules=SCHEDULE_NAMES, *, backward: float = 2.0,
                      answer: bool = True):
    """The simulated schedules drawn by `labkit.viz.pipeline_schedule.plot_schedule`, the function notebook 07
    uses for the MEASURED schedule, so lecture and lab show the same picture; titled with the bubble.
    `backward`: a backward's length in forwards (1 = the one-slot grid of notebook 07's exercise, with a
    line per slot); `answer=False` leaves the bubble and the held micro-batches out, for the exercise
    that counts them."""
    import matplotlib.pyplot as plt

    from labkit.viz.pipeline_schedule import plot_schedule

    schedules = (schedules,) if isinstance(schedules, str) else tuple(schedules)
    fig, axes = plt.subplots(len(schedules), 1, figsize=(11.0, 0.9 + 0.62 * stages * len(schedules)), squeeze=False)
    formula = comm.bubble_fraction(stages, microbatches)
    for a, name in zip(axes[:, 0], schedules):
        table = pipeline_table(stages, microbatches, name, backward=backward)
        span = max(op.end for op in table)
        title = f"{'GPipe' if name == 'gpipe' else '1F1B'}: p = {stages}, m = {microbatches}"
        plot_schedule(schedule_events(table), ax=a, title=title + (
            f", bubble {table_bubble(table):.0%} = (p-1)/(m+p-1) = {formula:.0%}" if answer else ""))
        a.get_legend().remove()  # the boxes say F0 / B0 themselves
        if answer:
            for s in range(stages):
                a.text(span * 1.01, s, f"holds {in_flight(table, s)}", va="center", fontsize=8)
        else:  # one column per time slot, to count
            a.set_xticks(range(int(span) + 1))
            a.grid(axis="x", color="#999999", lw=0.5)
            a.set_axisbelow(True)
        a.set_xlim(0, span * (1.12 if answer else 1.0))
        a.set_xlabel("")
    unit = "one forward = 1, one backward = 2" if backward == 2.0 else f"one forward = 1, one backward = {backward:g}"
    axes[-1, 0].set_xlabel(f"time ({unit}); white = bubble" + ("; holds = peak micro-batches of activations"
                                                                if answer else ""))
    fig.tight_layout()
    return fig
