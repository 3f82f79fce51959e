"""Read a Chrome / Perfetto trace of training steps: where the time went and what memory peaked.

Pure Python over the JSON that `torch.profiler` exports (`labkit.profiling.profiler` records it), so it reads
traces from any machine, GPU node or laptop. Steps are found by their `labkit step N` (or torch's
`ProfilerStep#N`) annotations; the training thread is the one that ran them.

Time: every microsecond of the training thread inside a step is charged to exactly one category, by
the innermost enclosing span that names one -- `enumerate(DataLoader)` = data loading,
`Optimizer.step#` / `Optimizer.zero_grad#` = optimizer, c10d / gloo / NCCL / FSDP collectives =
communication -- else `compute` inside a torch op, else `other` (Python, hooks, waiting). Background
threads (gloo runs collectives on its own threads) are reported separately: they overlap the
training thread. On a CUDA trace the training thread only launches work, so the shares come from the
GPU streams instead (`gpu_breakdown`: compute vs exposed communication, NCCL kernels hidden behind
compute counted as overlapped). Introduced in notebook 08_profiling_and_stacking.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from labkit.errors import ConfigError

STEP_PREFIX = "labkit step "
CATEGORIES = ("compute", "communication", "data loading", "optimizer", "other")
#: Op / annotation names that move data between ranks (c10d ops, gloo / NCCL work, FSDP collectives).
COMM_MARKERS = ("c10d::", "gloo:", "nccl", "all_gather", "allgather", "reduce_scatter", "all_reduce",
                "allreduce", "post_backward_reduce", "rs_wait", "record_param_comms")
#: torch.profiler memory categories, in the order of `export_memory_timeline`'s columns 1..8.
MEMORY_CATEGORIES = ("parameter", "optimizer state", "input", "temporary", "activation", "gradient",
                     "autograd detail", "unknown")


def load_trace(path) -> dict:
    """A Chrome trace as a dict; a folder means its trace.json."""
    path = Path(path)
    path = path / "trace.json" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"no trace at {path}; record one with `labkit train ... --trace-steps 2`")
    data = json.loads(path.read_text(encoding="utf-8"))
    if "traceEvents" not in data:
        raise ConfigError(f"{path} is not a Chrome trace (no traceEvents)")
    return data


@dataclass(eq=False)
class _Node:
    event: dict
    end: float
    parent: "_Node | None" = None
    child_time: float = 0.0

    @property
    def name(self) -> str:
        return self.event["name"]


def _spans(trace: dict, tid=None, *, python: bool = False) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e
            and (tid is None or e.get("tid") == tid) and (python or e.get("cat") != "python_function")]


def _steps(trace: dict) -> list[dict]:
    steps = [e for e in _spans(trace) if e["name"].startswith((STEP_PREFIX, "ProfilerStep#"))]
    if not steps:
        raise ConfigError("the trace has no 'labkit step N' (or ProfilerStep#N) annotation: record it with "
                          "--trace-steps N, or mark your steps with torch.profiler.record_function")
    return sorted(steps, key=lambda e: e["ts"])


def _forest(events: list[dict]) -> list[_Node]:
    """Nest one thread's spans by time containment; each node learns how much of it its children cover."""
    nodes = [_Node(e, e["ts"] + e["dur"]) for e in sorted(events, key=lambda e: (e["ts"], -e["dur"]))]
    stack: list[_Node] = []
    for node in nodes:
        while stack and stack[-1].end <= node.event["ts"]:
            stack.pop()
        if stack:
            node.parent = stack[-1]
            node.parent.child_time += min(node.end, node.parent.end) - node.event["ts"]
        stack.append(node)
    return nodes


def _category(name: str) -> str | None:
    if name.startswith(("enumerate(DataLoader)", "labkit:data")):
        return "data loading"
    if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
        return "optimizer"
    low = name.lower()
    return "communication" if any(m in low for m in COMM_MARKERS) else None


def _classify(node: _Node) -> tuple[str | None, str | None]:
    """(category of the node's self time, its step) -- the innermost named category wins; ops outside
    any are compute; time in annotations but outside ops (Python, hooks, waiting) is 'other'."""
    special, step, cur = None, None, node
    while cur is not None:
        special = special or _category(cur.name)
        if cur.name.startswith((STEP_PREFIX, "ProfilerStep#")):
            step = cur.name
        cur = cur.parent
    if step is None:
        return None, None
    idle = node.event.get("cat") in ("user_annotation", "python_function") or step == node.name
    return special or ("other" if idle else "compute"), step


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _clip(events, steps) -> list[tuple[float, float]]:
    return [(max(e["ts"], s["ts"]), min(e["ts"] + e["dur"], s["ts"] + s["dur"])) for e in events for s in steps
            if e["ts"] < s["ts"] + s["dur"] and e["ts"] + e["dur"] > s["ts"]]


def time_breakdown(trace: dict) -> dict:
    """Where the traced steps' wall time went, by category (the shares sum to 1).

    CPU traces: the training thread's time (see the module doc). CUDA traces (they hold GPU kernel
    events): the GPU's time, because the training thread only launches kernels and its ops return
    before the work is done (`source` says which). Also: `thread_shares` (the training thread, always),
    the share of time background threads (gloo) were communicating and, on CUDA, `gpu` (busy and
    overlapped communication, see `gpu_breakdown`)."""
    steps = _steps(trace)
    tid = steps[0]["tid"]
    wall = sum(s["dur"] for s in steps)
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for node in _forest(_spans(trace, tid)):
        category, _ = _classify(node)
        if category:
            totals[category] += max(0.0, node.end - node.event["ts"] - node.child_time)
    device = ("kernel", "gpu_")  # GPU-side events: reported below, not as background threads
    others = [e for e in _spans(trace) if e.get("tid") != tid and not str(e.get("cat", "")).startswith(device)]
    background = _union(_clip([e for e in others if _category(e["name"]) == "communication"], steps))
    thread = {k: v / wall for k, v in totals.items()}
    out = {"steps": len(steps), "wall_s": wall / 1e6, "step_s": wall / 1e6 / len(steps), "source": "training thread",
           "shares": thread, "thread_shares": thread, "background_comm_share": background / wall}
    gpu = gpu_breakdown(trace, steps, tid)
    if gpu is not None:
        out.update(source="gpu streams", shares=gpu.pop("shares"), gpu=gpu)
    return out


def _kernel_category(event: dict, launched_in) -> str:
    """NCCL kernels communicate; any other GPU event belongs to what launched it (optimizer, data
    loading: the input copy) or else is compute."""
    if "nccl" in event["name"].lower():
        return "communication"
    return launched_in(event.get("args", {}).get("correlation")) or "compute"


def _launch_lookup(trace: dict, tid):
    """correlation id -> category of the training-thread span that launched the kernel (or None)."""
    spans = _spans(trace, tid)
    named = sorted((e["ts"], e["ts"] + e["dur"], cat) for e in spans
                   for cat in [_category(e["name"])] if cat in ("optimizer", "data loading"))
    launches = {e["args"]["correlation"]: e["ts"] for e in trace["traceEvents"]
                if e.get("tid") == tid and str(e.get("cat", "")).startswith("cuda_") and
                "correlation" in e.get("args", {})}

    def launched_in(correlation):
        ts = launches.get(correlation)
        return None if ts is None else next((cat for a, b, cat in named if a <= ts <= b), None)
    return launched_in


def gpu_breakdown(trace: dict, steps: list[dict], tid) -> dict | None:
    """The GPU's timeline in the steps, cut into CATEGORIES (None for a trace without GPU events).

    torch.profiler writes GPU work as complete events with cat "kernel" / "gpu_memcpy" / "gpu_memset"
    on the device's stream rows, each with args.correlation pointing to the CUDA runtime call that
    launched it. Each instant of the step goes to ONE category: a compute kernel if any runs (NCCL
    running beside it is hidden, "overlapped"), else an optimizer / data-loading kernel, else NCCL
    alone ("communication": exposed communication, the time the GPU waits on the network), else the
    GPU idles -- "data loading" if the training thread was loading data then, else "other" (launch
    overhead, Python, host synchronisation). The same split as PyTorch's Holistic Trace Analysis
    ("temporal breakdown" into compute / communication / idle, "communication computation overlap").
    Unverified on hardware here: tested on a hand-built trace in the shape torch.profiler writes."""
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    gpu_events = [e for e in _spans(trace) if e.get("cat") in kinds]
    if not gpu_events:
        return None
    launched_in = _launch_lookup(trace, tid)
    rank = {"compute": 0, "optimizer": 1, "data loading": 2, "communication": 3, "cpu data": 4}
    marks = [(s["ts"], 0, "step") for s in steps] + [(s["ts"] + s["dur"], 1, "step") for s in steps]
    for e in gpu_events:
        cat = _kernel_category(e, launched_in)
        marks += [(e["ts"], 0, cat), (e["ts"] + e["dur"], 1, cat)]
    for e in _spans(trace, tid):  # what the CPU did while the GPU idled
        if _category(e["name"]) == "data loading":
            marks += [(e["ts"], 0, "cpu data"), (e["ts"] + e["dur"], 1, "cpu data")]
    active = dict.fromkeys([*rank, "step"], 0)
    totals = dict.fromkeys(CATEGORIES, 0.0)
    busy = dict.fromkeys(("compute", "communication", "overlapped communication"), 0.0)
    last = None
    for t, is_end, cat in sorted(marks):
        if last is not None and active["step"] and t > last:
            dt = t - last
            on = [c for c in rank if active[c]]
            top = min(on, key=rank.get) if on else None
            totals[{"cpu data": "data loading", None: "other"}.get(top, top)] += dt
            computing = any(active[c] for c in ("compute", "optimizer", "data loading"))
            busy["compute"] += dt if computing else 0.0
            busy["communication"] += dt if active["communication"] else 0.0
            busy["overlapped communication"] += dt if computing and active["communication"] else 0.0
        active[cat] += -1 if is_end else 1
        last = t
    wall = sum(s["dur"] for s in steps)
    out = {f"{k} busy" if k != "overlapped communication" else k: v / wall for k, v in busy.items()}
    out["exposed communication"] = totals["communication"] / wall
    out["shares"] = {k: v / wall for k, v in totals.items()}
    return out


def top_ops(trace: dict, n: int = 10) -> list[dict]:
    """The ops with the most self time on the training thread in the traced steps."""
    steps = _steps(trace)
    agg: dict[str, list[float]] = {}
    for node in _forest(_spans(trace, steps[0]["tid"])):
        if node.event.get("cat") == "cpu_op" and _classify(node)[1]:
            row = agg.setdefault(node.name, [0.0, 0])
            row[0] += max(0.0, node.end - node.event["ts"] - node.child_time)
            row[1] += 1
    wall = sum(s["dur"] for s in steps)
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"name": k, "self_ms": v[0] / 1e3, "calls": v[1], "share": v[0] / wall} for k, v in rows]


def _where(trace: dict, tid, ts: float) -> dict:
    """What ran on thread `tid` at time `ts`: step, phase, innermost op and module."""
    chain = sorted((e for e in _spans(trace, tid, python=True) if e["ts"] <= ts <= e["ts"] + e["dur"]),
                   key=lambda e: -e["dur"])
    names = [e["name"] for e in chain]
    ops = [e["name"] for e in chain if e.get("cat") == "cpu_op"]
    modules = [m.split(": ", 1)[1] for m in names if m.startswith("nn.Module: ")]
    phase = ("optimizer" if any(m.startswith("Optimizer.") for m in names) else
             "backward" if any("autograd::engine" in m or "backward" in m.lower() for m in names) else
             "data loading" if any(m.startswith("enumerate(DataLoader)") for m in names) else "forward")
    step = next((m for m in names if m.startswith(STEP_PREFIX)), None)
    return {"step": step[len(STEP_PREFIX):] if step else None, "phase": phase,
            "op": ops[-1] if ops else None, "module": modules[-1] if modules else None}


def memory_peak(trace: dict, timeline=None, *, top: int = 5) -> dict:
    """The allocator's peak in the traced steps, where it happened, and the largest blocks live then
    (with the op that allocated them). `timeline` (export_memory_timeline JSON) adds bytes by category."""
    steps = _steps(trace)
    lo, hi = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    mem = sorted((e for e in trace["traceEvents"] if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    cuda = any(e["args"].get("Device Type") == 1 for e in mem)
    mem = [e for e in mem if e["args"].get("Device Type") == (1 if cuda else 0)]
    inside = [e for e in mem if lo <= e["ts"] <= hi]
    if not inside:
        raise ConfigError("the trace holds no memory events; record with profile_memory=True (--trace-steps does)")
    peak = max(inside, key=lambda e: e["args"]["Total Allocated"])
    live: dict = {}
    for e in mem:
        if e["ts"] > peak["ts"]:
            break
        size = e["args"]["Bytes"]
        if size > 0:
            live[e["args"]["Addr"]] = e
        else:
            live.pop(e["args"]["Addr"], None)
    blocks = sorted(live.values(), key=lambda e: -e["args"]["Bytes"])[:top]
    out = {"device": "cuda" if cuda else "cpu", "bytes": int(peak["args"]["Total Allocated"]),
           "ms": (peak["ts"] - lo) / 1e3, **_where(trace, peak.get("tid"), peak["ts"]),
           "live": [{"bytes": int(b["args"]["Bytes"]), **_where(trace, b.get("tid"), b["ts"])} for b in blocks],
           "by_category": None}
    if timeline is not None and Path(timeline).is_file():
        times, sizes = json.loads(Path(timeline).read_text(encoding="utf-8"))
        if times:
            i = max(range(len(times)), key=lambda j: sum(sizes[j][1:]))
            out["by_category"] = dict(zip(MEMORY_CATEGORIES, sizes[i][1:]))
            out["category_peak_bytes"] = int(sum(sizes[i][1:]))
    return out


def _memory_events(trace: dict, lo: float, hi: float) -> list[dict]:
    mem = [e for e in trace["traceEvents"] if e.get("name") == "[memory]"]
    kind = 1 if any(e["args"].get("Device Type") == 1 for e in mem) else 0
    return sorted((e for e in mem if e["args"].get("Device Type") == kind and lo <= e["ts"] <= hi),
                  key=lambda e: e["ts"])


def plot_memory(trace: dict, timeline=None, *, title: str = ""):
    """Bytes over the traced steps: stacked by category from `timeline` (export_memory_timeline JSON)
    when given, else the allocator's running total from the trace. Returns a matplotlib Figure."""
    from matplotlib.figure import Figure

    steps = _steps(trace)
    lo, hi = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    fig = Figure(figsize=(9, 3.8))
    ax = fig.subplots()
    if timeline is not None and Path(timeline).is_file():
        times, sizes = json.loads(Path(timeline).read_text(encoding="utf-8"))
        base = trace.get("baseTimeNanoseconds", 0) / 1e3  # timeline: us since the epoch; trace: us since base
        x = [max(0.0, (t - base - lo) / 1e3) for t in times]
        columns = list(zip(*[row[1:] for row in sizes])) if sizes else []
        kept = [(name, [v / 2**20 for v in col]) for name, col in zip(MEMORY_CATEGORIES, columns) if any(col)]
        ax.stackplot(x, *[col for _, col in kept], labels=[name for name, _ in kept], step="post", alpha=0.85)
        ax.legend(loc="upper left", fontsize=7, ncols=4)
        what = "live tensors by category (torch.profiler memory timeline)"
    else:
        mem = _memory_events(trace, lo, hi)
        ax.step([(e["ts"] - lo) / 1e3 for e in mem], [e["args"]["Total Allocated"] / 2**20 for e in mem],
                where="post", color="#4C72B0")
        what = "bytes allocated (trace [memory] events; on CPU counted from the start of the trace)"
    for i, step in enumerate(steps):
        a, b = (step["ts"] - lo) / 1e3, (step["ts"] + step["dur"] - lo) / 1e3
        ax.axvspan(a, b, color="#EEEEEE" if i % 2 else "#F8F8F8", zorder=0)
        ax.text(a, 1.0, f" {step['name']}", transform=ax.get_xaxis_transform(), fontsize=7, va="top")
    peak = memory_peak(trace)
    ax.axvline(peak["ms"], color="k", ls="--", lw=1)
    ax.annotate(f"allocator peak: {peak['phase']}, {peak['op']}", (peak["ms"], 0.5), fontsize=7,
                xycoords=("data", "axes fraction"), rotation=90, ha="right")
    ax.set_xlim(0, (hi - lo) / 1e3)
    ax.set_xlabel("ms since the first traced step")
    ax.set_ylabel("MiB")
    ax.set_title(f"{title}\n{what}" if title else what, fontsize=9)
    return fig
