"""Measuring a pipeline schedule: when each stage ran which micro-batch, and the bubble that follows.

`ScheduleTrace` wraps a `PipelineStage`'s chunk functions and records (kind, micro-batch, t0, t1) per
schedule run; `schedule_facts` turns the traces of all stages into the measured bubble (1 - busy /
span, averaged over stages), the in-flight micro-batches and the events of the last run that
`labkit.viz.pipeline_schedule` draws. Used by `labkit.parallel.pipeline` and `pipeline_virtual`.
Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

import statistics

from torch import nn

from labkit.parallel.comm import bubble_fraction, events_of, max_in_flight, stage_times
from labkit.parallel.comm import stage_bubbles as measured_bubble


class ScheduleTrace:
    """Records which micro-batch the stage computes when: (kind 'F'/'B', micro-batch, t0, t1).

    Wraps the stage's `forward_one_chunk` / `backward_one_chunk`, which every schedule calls; times
    are seconds of `time.perf_counter()` (one monotonic clock for all processes of a machine). On a
    GPU the chunk boundaries are CUDA events read at the end of each schedule run
    (`labkit.train.timing.WorkClock`): perf_counter alone would time the kernel launches.
    """

    def __init__(self, pipe_stage, clock=None):
        from labkit.train.timing import WorkClock

        self.steps: list[list[tuple]] = []
        self.recording = False  # off in evaluation (whose schedules call backward_one_chunk as a no-op)
        self.submod = pipe_stage.submod
        self.clock = clock or WorkClock(getattr(pipe_stage, "device", "cpu"))
        self._pending: list[tuple] = []
        for kind, attr in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
            setattr(pipe_stage, attr, self._timed(kind, getattr(pipe_stage, attr)))

    def _timed(self, kind: str, fn):
        def run(chunk_id, *args, **kwargs):
            if kind == "F":
                _let_memory_tracker_see(self.submod)
            token = self.clock.start()
            out = fn(chunk_id, *args, **kwargs)
            if self.recording:
                self._pending.append((kind, int(chunk_id), self.clock.stop(token)))
            return out
        return run

    def begin_step(self) -> None:
        """Start recording one schedule run (one `schedule.step`)."""
        self.clock.begin_step()
        self._pending = []
        self.recording = True

    def end_step(self) -> None:
        self.recording = False
        times = self.clock.end_step([interval for _, _, interval in self._pending])
        self.steps.append([(kind, chunk, t0, t1) for (kind, chunk, _), (t0, t1) in zip(self._pending, times)])
        self._pending = []


def _let_memory_tracker_see(stage_module: nn.Module) -> None:
    """Before each micro-batch forward: let the harness's CPU MemTracker (active in one warm-up step)
    follow a pipeline schedule.

    MemTracker takes a second forward of a ROOT module for the next iteration and raises; resetting
    all its stats (what the loop does per micro-batch) would drop the entries that the still-pending
    backwards of earlier micro-batches look up. Dropping only the root's entry makes the next forward
    a fresh root call while the layers keep theirs. Uses MemTracker internals (torch 2.14): the
    harness has no hook for schedules that interleave micro-batches -- reported to its owner.
    """
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, MemTracker):
            mode.memory_tracking.pop(stage_module, None)


def schedule_facts(gathered: list[list[list[tuple]]], stages: int, microbatches: int, skip: int = 2) -> dict:
    """Bubble (theory vs measured: median over the schedule runs after the first `skip` warm-up
    runs), in-flight micro-batches per stage and the last run's events (the schedule diagram).
    `gathered[rank]` is that stage's `ScheduleTrace.steps` (one list per schedule run)."""

    steps = min(len(g) for g in gathered) if gathered else 0
    if not steps:
        return {"bubble_theory": bubble_fraction(stages, microbatches)}
    per_step = [events_of([g[i] for g in gathered]) for i in range(steps)]
    measured = [statistics.mean(measured_bubble(ev)) for ev in per_step]
    kept = measured[skip:] or measured
    times = [stage_times(ev) for ev in (per_step[skip:] or per_step)]  # per step: ms per micro-batch per stage
    last = per_step[-1]
    return {"bubble_theory": bubble_fraction(stages, microbatches), "bubble_measured": statistics.median(kept),
            "bubble_per_stage": [round(b, 4) for b in measured_bubble(last)],
            "stage_ms": [round(statistics.median(t), 4) for t in zip(*times)],
            "max_in_flight": max_in_flight(last), "schedule_trace": last}
