"""Visible tests of notebook 08's exercises: reading a profiler trace and a memory timeline, fixing an OOM.

A real trace and timeline of two training steps of a small MLP are recorded by torch.profiler on a fresh
rank that never loads the student's code (`trusted_spawn`); small hand-built traces and timelines then
isolate one classic mistake each (total instead of self time, ops outside the steps or on another thread,
the last row instead of the peak...), so a wrong answer names its mistake. Expected answers come from
labkit.profiling.traces (`top_ops`) computed here, or are written below with how they add up.
"""
from labkit.course.exercises import ANY, case, trusted_spawn


def _profiled(rank, world):
    """REFERENCE rank: (Chrome trace dict, memory timeline [times, sizes]) of two AdamW steps of a small MLP
    on CPU. The profiler's own log lines (kineto) go to /dev/null: they are not the student's business."""
    import json
    import os
    import tempfile
    import warnings
    from pathlib import Path

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters())
    x, t = torch.randn(32, 64), torch.randint(0, 10, (32,))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        for i in range(2):
            with record_function(f"ProfilerStep#{i}"):
                torch.nn.functional.cross_entropy(model(x), t).backward()
                opt.step()
                opt.zero_grad()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(str(Path(tmp) / "trace.json"))
        with warnings.catch_warnings():  # deprecated for CUDA in favour of the snapshot; still the CPU tool
            warnings.simplefilter("ignore", FutureWarning)
            prof.export_memory_timeline(str(Path(tmp) / "timeline.json"), device="cpu")
        return (json.loads((Path(tmp) / "trace.json").read_text()),
                json.loads((Path(tmp) / "timeline.json").read_text()))


def _recorded():
    return trusted_spawn(_profiled, world=1, timeout=300)[0]


# ---------------------------------------------------------------- top_bottleneck
def _x(name, ts, dur, tid=1, cat="cpu_op"):
    return dict(ph="X", name=name, ts=ts, dur=dur, tid=tid, pid=1, cat=cat)


def _steps(*ops):
    """A trace: two steps marked "labkit step 3" / "labkit step 4" (1000 us each from ts 10000) around `ops`."""
    marks = [_x(f"labkit step {i}", 10000 + 1000 * (i - 3), 1000, cat="user_annotation") for i in (3, 4)]
    return {"traceEvents": marks + list(ops)}


def _twice(*ops):
    """`ops` (name, start offset, duration) in both steps."""
    return [_x(name, 10000 + 1000 * k + t, d) for k in (0, 1) for name, t, d in ops]


#: One trap per trace: (trace, the answer, the tempting wrong answer, the fix that wrong answer needs).
LINEAR = (("aten::linear", 10, 500), ("aten::addmm", 20, 420), ("aten::relu", 600, 300))  # addmm nested in linear
TRAPS = (
    (_steps(*_twice(*LINEAR)), "aten::addmm", "aten::linear",
     "aten::linear's 2 x 500 us are mostly aten::addmm's, nested in it: an op's self time is its duration minus "
     "that of the spans directly nested in it (subtract its children)"),
    (_steps(_x("aten::copy_", 0, 5000), *_twice(*LINEAR)), "aten::addmm", "aten::copy_",
     "aten::copy_ ran before the first step: count only the ops that start inside a step"),
    (_steps(_x("gloo:all_reduce", 10600, 390, tid=2), _x("gloo:all_reduce", 11600, 390, tid=2),
            *_twice(("aten::addmm", 20, 180), ("aten::relu", 300, 100))), "aten::addmm", "gloo:all_reduce",
     "gloo:all_reduce ran on another thread: count only the training thread's ops (the tid that ran the steps)"),
    (_steps(*_twice(("aten::addmm", 20, 250), ("aten::relu", 300, 300)),
            *[_x("<built-in method relu>", 10310 + 1000 * k, 290, cat="python_function") for k in (0, 1)]),
     "aten::relu", "aten::addmm",
     "aten::relu's time is under a python_function span: python_function spans do not count as children"),
    (_steps(*_twice(("aten::mul", 20, 100), ("aten::mul", 200, 100), ("aten::mul", 400, 100)),
            _x("aten::sum", 10600, 450)), "aten::mul", "aten::sum",
     "aten::mul runs 6 times for 100 us each, 600 us in all: sum the self time over all its calls"),
)


@case("top_bottleneck", points=2)
def the_real_traces_largest_self_time(student):
    from labkit.profiling.traces import top_ops

    trace, _ = _recorded()
    got = student.call(trace, returns=str)
    rows = {r["name"]: r["self_ms"] for r in top_ops(trace, 1000)}
    best = max(rows, key=rows.get)
    assert got in rows, f"{got!r} is not an op of the traced steps (the training thread's cpu_op events)"
    assert rows[got] >= 0.99 * rows[best], (f"{got!r} has {rows[got]:.2f} ms of self time in the steps; "
                                            f"{best!r} has {rows[best]:.2f} ms")


@case("top_bottleneck", points=2)
def each_trap_of_a_trace(student):
    from labkit.profiling.traces import top_ops

    for trace, want, wrong, fix in TRAPS:
        assert top_ops(trace, 1)[0]["name"] == want  # the library agrees with the answer written here
        got = student.call(trace, returns=str)
        assert got != wrong, f"you answered {wrong!r}, expected {want!r}: {fix}"
        assert got == want, f"you answered {got!r}, expected {want!r} (the most self time in the steps)"


# ---------------------------------------------------------------- peak_cause
CATEGORIES = ("parameter", "optimizer state", "input", "temporary", "activation", "gradient", "autograd detail",
              "unknown")


def _timeline(*rows):
    """[times, sizes]: column 0 unused (0), then the 8 categories."""
    return [[10 * i for i in range(len(rows))], [[0, *row] for row in rows]]


def _answer(sizes, i, shift=False):
    """(largest category, total) of row i; `shift`: the categories paired with columns 0.. instead of 1.."""
    row = sizes[i] if shift else sizes[i][1:]
    by_cat = dict(zip(CATEGORIES, row))
    return max(by_cat, key=by_cat.get), sum(sizes[i][1:])


def _peak(sizes):
    totals = [sum(row[1:]) for row in sizes]
    return totals.index(max(totals))


#: The tempting wrong answers (a function of the timeline's sizes) and the fix each needs.
PEAK_MISTAKES = (
    (lambda sizes: _answer(sizes, len(sizes) - 1),
     "the last row is not the peak: find the row where the total over the categories is highest"),
    (lambda sizes: _answer(sizes, max(range(len(sizes)), key=lambda j: max(sizes[j][1:]))),
     "the peak is the row with the largest TOTAL, not the largest single category: sum each row's categories"),
    (lambda sizes: _answer(sizes, _peak(sizes), shift=True),
     "column 0 is unused: the categories start at column 1, so sizes[i][1:] lines up with MEMORY_CATEGORIES"),
)
#: Timelines made so that each mistake above gives another answer than the right one.
TIMELINES = (
    _timeline([100, 0, 10, 0, 500, 0, 0, 0], [100, 0, 10, 0, 50, 100, 0, 0], [100, 380, 10, 0, 0, 0, 0, 0]),
    _timeline([100, 0, 10, 0, 450, 0, 0, 0], [100, 0, 10, 0, 200, 300, 0, 0], [100, 0, 10, 0, 0, 0, 0, 0]),
    _timeline([100, 0, 10, 0, 0, 0, 0, 0], [100, 0, 10, 0, 500, 0, 0, 0], [100, 0, 10, 0, 0, 0, 0, 0]),
)


def _check_peak(student, timeline):
    sizes = timeline[1]
    want = _answer(sizes, _peak(sizes))
    got = student.call(timeline, returns=(str, float))
    if got == want:
        return
    fix = next((why for wrong, why in PEAK_MISTAKES if wrong(sizes) == got != want),
               "the largest category at the first row whose total over the categories is highest, and that total")
    raise AssertionError(f"you answered {got}, expected {want} (of {len(sizes)} rows): {fix}")


@case("peak_cause", points=2)
def the_real_timelines_peak(student):
    _check_peak(student, _recorded()[1])


@case("peak_cause", points=2)
def timelines_where_each_shortcut_misses(student):
    for timeline in TIMELINES:
        _check_peak(student, timeline)


# ---------------------------------------------------------------- fix_oom
#: The fields the OOM fix must keep, and the fix of changing each.
KEEP = {"batch": "keep the batch (samples per GPU per step): run it as grad_accum micro-batches instead",
        "model": "keep the model", "seq": "keep the sequence length", "dp": "keep the parallel layout",
        "tp": "keep the parallel layout", "pp": "keep the parallel layout",
        "lora_rank": "keep a full fine-tune (no LoRA)", "quant": "keep a full fine-tune (no quantization)",
        "offload": "offload is not one of the levers"}
#: The levers, in the docstring's order, and the fix when one that was needed is missing.
LEVERS = {"precision": "switch fp32 to mixed-bf16 (precision='mixed-bf16')",
          "checkpointing": "turn on activation checkpointing (checkpointing='full')",
          "zero": "shard with ZeRO-3 (zero=3) when dp > 1", "optimizer": "use 8-bit AdamW (optimizer='adamw-8bit')"}


def _fixed(fix_oom, cfg, capacity):
    """HARNESS (student's side): the fields of the MemoryConfig fix_oom returned, or the error it raised."""
    import dataclasses

    try:
        new = fix_oom(cfg, capacity)
    except ValueError as exc:
        return {"raised": f"ValueError: {exc}"[:200]}
    if not dataclasses.is_dataclass(new) or isinstance(new, type):
        return {"type": type(new).__name__}
    return {"fields": {f.name: getattr(new, f.name) for f in dataclasses.fields(new)}}


def check_fix(student, cfg, capacity, want):
    """`want`: the changed fields {name: value} ({} = cfg itself), or ValueError."""
    from labkit.memory.estimate import MemoryConfig, estimate

    label = f"fix_oom({cfg.model}, {cfg.precision}, dp={cfg.dp}, batch={cfg.batch}, seq={cfg.seq}, " \
            f"{capacity / 1e9:g} GB)"
    got = student.run(_fixed, cfg, capacity, returns={str: ANY})
    if want is ValueError:
        assert "raised" in got, (f"{label} returned a config; nothing fits ({estimate(cfg).total / 1e9:.1f} GB "
                                 "before any lever): raise ValueError when even every lever does not fit")
        return
    assert "raised" not in got, (f"{label} raised {got['raised']}, but {want} fits: " +
                                 "; ".join(LEVERS[k] for k in want if k in LEVERS))
    assert "fields" in got, f"{label} returned a {got.get('type')}: return a MemoryConfig (cfg.replace(...))"
    new = MemoryConfig(**got["fields"])
    changed = {k: v for k, v in got["fields"].items() if getattr(cfg, k) != v}
    for key, fix in KEEP.items():
        assert key not in changed, f"{label} changed {key} from {getattr(cfg, key)!r} to {changed[key]!r}: {fix}"
    assert estimate(new).fits(capacity), (f"{label}: your config estimates {estimate(new).total / 1e9:.1f} GB, "
                                          f"above {capacity / 1e9:g} GB: it still does not fit")
    if not want:
        assert not changed, f"{label} changed {changed}: it already fits, return cfg itself"
    applied, wanted = [k for k in LEVERS if k in changed], [k for k in LEVERS if k in want]
    if len(wanted) > 1 and applied == wanted[-1:]:  # each lever built on cfg: only the last one survives
        raise AssertionError(f"{label} changed {changed}, expected {want}: only the last lever ({applied[0]}) is "
                             "left: keep each lever once applied, building on the config so far "
                             "(cur = cur.replace(...), not cfg.replace(...))")
    for key, fix in LEVERS.items():
        if key in want and key not in changed:
            raise AssertionError(f"{label} changed {changed}, expected {want}: {fix} before accumulating")
        if key in changed and key not in want:
            raise AssertionError(f"{label} changed {changed}, expected {want}: {key} was not needed; try the levers "
                                 "in the docstring's order and stop at the first config that fits")
    if changed.get("grad_accum", 1) > want.get("grad_accum", 1):
        raise AssertionError(f"{label}: grad_accum={changed['grad_accum']}, but {want.get('grad_accum', 1)} fits "
                             "too: use the smallest grad_accum that fits (each micro-batch costs a forward and "
                             "backward pass)")
    assert changed == want, f"{label} changed {changed}, expected {want}"


@case("fix_oom", points=2)
def fp32_1b_needs_every_lever_then_accumulation(student):
    from labkit.memory.estimate import MemoryConfig

    check_fix(student, MemoryConfig(model="llama3.2-1b", precision="fp32", batch=32, seq=1024), 40e9,
              dict(precision="mixed-bf16", checkpointing="full", optimizer="adamw-8bit", grad_accum=2))


@case("fix_oom", points=2)
def seven_b_over_4_gpus_shards(student):
    from labkit.memory.estimate import MemoryConfig

    check_fix(student, MemoryConfig(model="llama2-7b", dp=4, batch=8, seq=4096), 80e9,
              dict(checkpointing="full", zero=3))


@case("fix_oom", points=1)
def fits_already_or_never(student):
    from labkit.memory.estimate import MemoryConfig

    check_fix(student, MemoryConfig(model="tinyllama-1.1b", batch=1, seq=512), 80e9, {})
    check_fix(student, MemoryConfig(model="llama2-7b", batch=8, seq=4096), 8e9, ValueError)
