"""Profile first: record N training steps with torch.profiler and say where the time and memory went.

`labkit train ... --trace-steps N` wraps N steps of the one training loop in a `StepTracer`; rank 0
writes to OUT/profiles/<run id>/:

- `trace.json`: the Chrome / Perfetto trace (`traceEvents`; open it in https://ui.perfetto.dev or
  chrome://tracing). CPU activity always, CUDA kernels and memcpys on GPU profiles; memory
  allocations, input shapes, Python stacks with nn.Module spans.
- `memory_timeline.png` (+ `memory_timeline.json` when the profiler's categorizer succeeds): bytes
  over the traced steps, stacked by category (parameters, optimizer state, activations, gradients,
  ...) or, where torch's memory categorizer fails (it asserts on FSDP2 traces), the allocator's
  total from the trace's `[memory]` events.
- `summary.txt`: the top ops by self time, the share of step time in compute, communication, data
  loading and optimizer, and the peak-memory moment with what was live then.
- GPU profiles: `cuda_memory_snapshot.pickle` (`torch.cuda.memory._record_memory_history`; drop it
  on https://pytorch.org/memory_viz). Nsight Systems: see docs/profiling.md (`--trace-with nsys`).

The first two steps of a run carry the loop's FLOP and memory measurements, so the window starts at
the third step. The analysis half (`summarize`, `time_breakdown`, `top_ops`, `memory_peak`) reads
trace files only, so it works on traces from any machine. Introduced in notebook 08_profiling_and_stacking.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from labkit.errors import ConfigError, choices_error
from labkit.profiling.traces import (CATEGORIES, STEP_PREFIX, load_trace, memory_peak, plot_memory,
                                   time_breakdown, top_ops)

FIRST_TRACED = 2  # local steps 0 and 1 carry FlopCounterMode / MemTracker (labkit.train.loop)
TOOLS = ("torch", "nsys")


# ------------------------------------------------------------------------------------ the window
def window(cfg) -> range:
    """Local step indices a run traces (empty without --trace-steps)."""
    n = getattr(getattr(cfg, "profiling", None), "trace_steps", 0) or 0
    return range(FIRST_TRACED, FIRST_TRACED + n) if n else range(0)


def check(cfg, device_type: str) -> None:
    """ConfigError for a trace window the run cannot hold, or nsys without CUDA."""
    n, tool = getattr(getattr(cfg, "profiling", None), "trace_steps", 0) or 0, getattr(getattr(cfg, "profiling", None), "trace_with", "torch")
    if tool not in TOOLS:
        raise choices_error("trace tool", tool, TOOLS)
    if n and cfg.run.steps < FIRST_TRACED + n:
        raise ConfigError(f"--trace-steps {n} records steps {FIRST_TRACED + 1}-{FIRST_TRACED + n} (the first "
                          f"{FIRST_TRACED} steps carry the FLOP and memory measurements); use --steps >= "
                          f"{FIRST_TRACED + n} or fewer trace steps")
    if n and tool == "nsys" and device_type != "cuda":
        raise ConfigError("--trace-with nsys brackets CUDA work for Nsight Systems; on a CPU profile use "
                          "--trace-with torch")


def profile_dir(cfg) -> Path:
    return Path(cfg.run.out) / "profiles" / (cfg.run.run_id or cfg.run.strategy)


def record_facts(cfg) -> dict:
    """`labkit.facts.TrainFacts` fields: how many steps were traced and where the files are."""
    n = len(window(cfg))
    return {"trace_steps": n, "profile_dir": str(profile_dir(cfg)) if n else None}


@dataclass(frozen=True)
class ProfileFiles:
    """What a traced run wrote (None for files a device does not produce)."""

    folder: Path
    trace: Path | None
    memory_figure: Path | None
    summary: Path | None
    memory_timeline: Path | None = None
    cuda_snapshot: Path | None = None


# ------------------------------------------------------------------------------------ recording
class StepTracer:
    """torch.profiler over the loop's steps in `steps` on one rank; rank 0 writes the files.

    All ranks profile (so every rank pays the same overhead and rank 0's waits are real); the loop
    calls `before(local)` at the top of each step and `after(local)` at its end, `finish()` after the
    last step and `close()` in its `finally`.
    """

    def __init__(self, folder, steps: range, *, device, is_main: bool, tool: str = "torch", title: str = ""):
        self.folder, self.steps, self.device = Path(folder), steps, device
        self.is_main, self.tool, self.title = is_main, tool, title
        self.prof, self._marks, self.files, self._recording = None, [], None, False

    @classmethod
    def for_run(cls, cfg, ctx) -> "StepTracer":
        from labkit.runtime import device as devices
        check(cfg, devices.mesh_device_type(ctx.device))
        return cls(profile_dir(cfg), window(cfg), device=ctx.device, is_main=ctx.is_main,
                   tool=getattr(getattr(cfg, "profiling", None), "trace_with", "torch"),
                   title=f"{cfg.run.strategy} {cfg.run.model} x{ctx.world_size} ({cfg.run.profile})")

    def before(self, local: int) -> None:
        if local not in self.steps:
            return
        if local == self.steps.start:
            self._start()
        import torch
        mark = torch.autograd.profiler.record_function(f"{STEP_PREFIX}{local + 1}")
        mark.__enter__()
        self._marks.append(mark)
        from labkit.runtime import device as devices
        from labkit.runtime import allocator
        if devices.is_gpu(self.device):
            allocator.nvtx_push(f"{STEP_PREFIX}{local + 1}")

    def after(self, local: int) -> None:
        if local not in self.steps or not self._marks:
            return
        from labkit.runtime import device as devices
        from labkit.runtime import allocator
        if devices.is_gpu(self.device):
            allocator.nvtx_pop()
        self._marks.pop().__exit__(None, None, None)
        if local == self.steps[-1]:
            self._stop()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        from labkit.runtime import device as devices
        from labkit.runtime import allocator
        cuda = devices.is_gpu(self.device)
        if cuda:
            # The allocator's own history (stack per allocation), for pytorch.org/memory_viz.
            allocator.start_history(self.device)
            allocator.cuda_profiler(start=True)  # nsys --capture-range=cudaProfilerApi starts here
        if self.tool == "torch":
            # CUDA activity only where CUDA is (a rehearsal's stand-in CPU has none to trace)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = profile(activities=activities, profile_memory=True, record_shapes=True,
                                with_stack=True)  # with_stack also records nn.Module spans
            self.prof.start()
        self._recording = True

    def _stop(self) -> None:
        if not self._recording:
            return
        self._recording = False
        from labkit.runtime import device as devices
        from labkit.runtime import allocator
        while self._marks:  # a run stopped inside the window (deadline): close the open step
            self._marks.pop().__exit__(None, None, None)
        if self.prof is not None:
            self.prof.stop()
        if devices.is_gpu(self.device):
            allocator.synchronize(self.device)
            allocator.cuda_profiler(start=False)
            if self.is_main:
                self.folder.mkdir(parents=True, exist_ok=True)
            allocator.stop_history(self.device, self.folder / "cuda_memory_snapshot.pickle" if self.is_main else None)

    def finish(self) -> ProfileFiles | None:
        """Stop if still recording; rank 0 writes trace, memory figure and summary. Returns the files."""
        self._stop()
        if not self.is_main or not self.steps:
            return None
        snapshot = self.folder / "cuda_memory_snapshot.pickle"
        snapshot = snapshot if snapshot.is_file() else None
        if self.prof is None:  # nsys: the report is nsys' own file
            self.files = ProfileFiles(self.folder, None, None, None, cuda_snapshot=snapshot)
        else:
            self.files = dataclasses.replace(write(self.prof, self.folder, self.device, title=self.title),
                                             cuda_snapshot=snapshot)
        return self.files

    def close(self) -> None:
        """Stop recording without writing (the run failed)."""
        if self._recording:
            self._stop()


def write(prof, folder, device, *, title: str = "") -> ProfileFiles:
    """Export a stopped profiler's trace, the memory timeline figure and the text summary."""
    import warnings

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / "trace.json"
    prof.export_chrome_trace(str(trace))
    timeline, note = folder / "memory_timeline.json", ""
    try:
        with warnings.catch_warnings():  # deprecated for CUDA in favour of the snapshot; still the CPU tool
            warnings.simplefilter("ignore", FutureWarning)
            prof.export_memory_timeline(str(timeline), device=str(device))
    except Exception as exc:  # noqa: BLE001 - torch's categorizer asserts on some graphs (FSDP2)
        timeline.unlink(missing_ok=True)
        timeline, note = None, f"{type(exc).__name__}: {str(exc)[:120]}"
    summary = summarize(folder, title=title, categorizer_error=note)
    figure = folder / "memory_timeline.png"
    plot_memory(summary.trace, timeline, title=title).savefig(figure, dpi=110, bbox_inches="tight")
    text = folder / "summary.txt"
    text.write_text(summary.text + "\n", encoding="utf-8")
    return ProfileFiles(folder, trace, figure, text, memory_timeline=timeline)




# ------------------------------------------------------------------------------------ the summary
def _mb(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


@dataclass(frozen=True)
class Summary:
    """What a trace says: time shares, top ops, the memory peak. `text` is summary.txt."""

    title: str
    time: dict
    """`trace_analysis.time_breakdown`: steps, step_s, shares by category (of the GPU's time on a CUDA
    trace, of the training thread's on CPU: `source`), background communication, `gpu` details."""
    ops: list
    """`trace_analysis.top_ops`: name, self_ms, calls, share."""
    peak: dict
    """`trace_analysis.memory_peak`: bytes, step, phase, op, module, live blocks, by_category."""
    categorizer_error: str = ""
    trace: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def bottleneck(self) -> str:
        """The category with the largest share of step time (the GPU's time on a CUDA trace)."""
        return max(self.time["shares"], key=self.time["shares"].get)

    @property
    def text(self) -> str:
        t, p = self.time, self.peak
        gpu = t.get("gpu")
        lines = [f"profile of {self.title or 'a run'}: {t['steps']} traced step(s), {t['step_s'] * 1e3:.1f} ms "
                 "per step with the profiler on",
                 "time share of the GPU (idle GPU time: 'data loading' if the CPU was loading, else 'other'):"
                 if gpu else "time share of the training thread:"]
        lines += [f"  {k:<14} {100 * t['shares'][k]:5.1f} %" for k in CATEGORIES]
        if gpu:
            lines.append(f"  communication: NCCL busy {100 * gpu['communication busy']:.1f} %, of which "
                         f"{100 * gpu['overlapped communication']:.1f} % hidden behind compute and "
                         f"{100 * gpu['exposed communication']:.1f} % exposed (the GPU only waited)")
        else:
            lines.append(f"  (gloo/background threads communicated during {100 * t['background_comm_share']:.1f} % "
                         "of the step time, overlapping the above)")
        lines.append(f"bottleneck: {self.bottleneck} ({100 * t['shares'][self.bottleneck]:.0f} % of step time)")
        lines.append("top ops by self time:")
        lines += [f"  {i:2d}. {o['name'][:44]:<44} {o['self_ms']:8.2f} ms {100 * o['share']:5.1f} %  "
                  f"({o['calls']} calls)" for i, o in enumerate(self.ops, 1)]
        lines.append(f"peak memory ({p['device']} allocator): {_mb(p['bytes'])} at {p['ms']:.1f} ms, step "
                     f"{p['step']}, {p['phase']}, in {p['op']}" + (f" ({p['module']})" if p["module"] else ""))
        lines.append("  largest blocks live then, by the op that allocated them:")
        lines += [f"    {_mb(b['bytes']):>11}  {b['op']}  {b['module'] or ''}  ({b['phase']}, step {b['step']})"
                  for b in p["live"]]
        if p.get("by_category"):
            parts = ", ".join(f"{k} {_mb(v)}" for k, v in p["by_category"].items() if v)
            lines.append(f"  live tensors at the timeline's peak ({_mb(p['category_peak_bytes'])}): {parts}")
        elif self.categorizer_error:
            lines.append(f"  (torch's memory categorizer failed on this trace: {self.categorizer_error})")
        return "\n".join(lines)


def summarize(source, *, title: str = "", categorizer_error: str = "", top: int = 10) -> Summary:
    """Summary of a trace file or of a profile folder (trace.json [+ memory_timeline.json])."""
    source = Path(source)
    trace = load_trace(source)
    timeline = source / "memory_timeline.json" if source.is_dir() else None
    return Summary(title=title, time=time_breakdown(trace), ops=top_ops(trace, top),
                   peak=memory_peak(trace, timeline), categorizer_error=categorizer_error, trace=trace)
