"""When did this rank's device do a piece of work? Intervals on one clock for all ranks of a node.

On CPU the work runs while Python waits, so `time.perf_counter()` around it is the answer. On CUDA a
Python call only *launches* kernels and returns (CUDA is asynchronous): perf_counter around a chunk
measures the launch, and a pipeline's bubble and schedule diagram come out wrong. There the clock
records CUDA events on the current stream around the work (`torch.cuda.Event(enable_timing=True)`,
the documented way to time GPU work: "to accurately measure timing") and reads them once at the end
of the step, after one synchronize, as milliseconds since an origin event recorded when the device
was idle. Adding that origin's perf_counter time puts every rank's GPU intervals on the machine's
monotonic clock, so stages (processes) line up in one diagram. Introduced in notebook 07_pipeline.
"""
from __future__ import annotations

import time

import torch

from labkit.runtime import allocator
from labkit.runtime import device as devices


class WorkClock:
    """Intervals of device work in seconds of `time.perf_counter()`.

    Use: `begin_step()`; per piece of work `token = start()`, work, `pending = stop(token)`;
    `end_step(pendings)` -> [(t0, t1), ...] in the same order.
    """

    def __init__(self, device: torch.device | str = "cpu", *, event_factory=None):
        self.device = torch.device(device)
        self.cuda = devices.is_gpu(self.device)
        # Unverified on hardware here: the CUDA path is tested on CPU with a stand-in event class.
        self._event = event_factory or allocator.timing_event
        self._origin = None
        self._origin_s = 0.0

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = self._event()
        event.record()  # on torch.cuda.current_stream(): after the work launched before it
        return event

    def begin_step(self) -> None:
        """Mark the origin: on CUDA, wait for the device to be idle so the origin event's GPU time and
        its perf_counter time are the same instant."""
        if self.cuda:
            allocator.synchronize(self.device)
            self._origin = self._now()
            self._origin_s = time.perf_counter()

    def start(self):
        return self._now()

    def stop(self, token) -> tuple:
        return token, self._now()

    def end_step(self, pending: list[tuple]) -> list[tuple[float, float]]:
        """The (t0, t1) seconds of each `stop()` result; on CUDA one synchronize for all of them."""
        if not self.cuda:
            return [(float(a), float(b)) for a, b in pending]
        allocator.synchronize(self.device)
        origin, base = self._origin, self._origin_s
        return [(base + origin.elapsed_time(a) / 1e3, base + origin.elapsed_time(b) / 1e3) for a, b in pending]
