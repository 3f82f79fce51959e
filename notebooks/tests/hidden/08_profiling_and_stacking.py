"""Hidden tests of notebook 08's exercises (run by `labkit grade`; students see only pass/fail per test and
VARIES). They reuse the visible file's traps, harness and checks with other inputs; a real trace is recorded
on a rank that never loads student code, and the OOM answers come from the grader's own copy of the levers."""
from labkit.course.exercises import case, reference, trusted_spawn
from labkit.course.exercises.cases import visible_twin

visible = visible_twin(__labkit_test_file__)  # noqa: F821 - set by the test loader

#: What the hidden tests vary, per exercise: `ex.check` and `labkit check` show this line, nothing else.
VARIES = {
    "top_bottleneck": "a real trace of a conv net marked with labkit's step names, and traces that combine the traps",
    "peak_cause": "timelines whose highest total occurs twice (the first moment counts) and other category mixes",
    "fix_oom": "other models, dp sizes and batches, one whose smallest fitting grad_accum is not a power of 2",
}

#: Classic mistakes. (fragment, replacement, fix): a VISIBLE test must fail with `fix` in its message;
#: (fragment, replacement): any test may catch it (tests/test_exercises_ci.py checks both).
MUTANTS = {
    "top_bottleneck": [
        ('totals.get(e["name"], 0.0) + e["dur"] - child', 'totals.get(e["name"], 0.0) + e["dur"]',
         "subtract its children"),
        ('any(s["ts"] <= e["ts"] < s["ts"] + s["dur"] for s in steps)', "True", "start inside a step"),
        ('e.get("tid") == tid', "True", "the training thread's ops"),
        ('and e.get("cat") != "python_function"]', "]", "python_function spans do not count as children"),
        ('totals.get(e["name"], 0.0) + e["dur"] - child', 'max(totals.get(e["name"], 0.0), e["dur"] - child)',
         "sum the self time over all its calls"),
        ('("ProfilerStep#", "labkit step ")', '"ProfilerStep#"'),
    ],
    "peak_cause": [
        ("i = totals.index(max(totals))", "i = len(totals) - 1", "the last row is not the peak"),
        ("i = totals.index(max(totals))", "i = max(range(len(sizes)), key=lambda j: max(sizes[j][1:]))",
         "not the largest single category"),
        ("zip(MEMORY_CATEGORIES, sizes[i][1:])", "zip(MEMORY_CATEGORIES, sizes[i])", "column 0 is unused"),
        ("i = totals.index(max(totals))", "i = len(totals) - 1 - totals[::-1].index(max(totals))"),
    ],
    "fix_oom": [
        ("dict(zero=3) if cfg.dp > 1 and cfg.zero < 3 else None", "None", "shard with ZeRO-3"),
        ("if fits(cur.replace(grad_accum=accum)):", "if accum == (cfg.batch or 1):",
         "use the smallest grad_accum that fits"),
        ("return cur.replace(grad_accum=accum)", "return cur.replace(batch=cfg.batch // accum)", "keep the batch"),
        ('dict(precision="mixed-bf16") if cfg.precision == "fp32" else None', "None", "switch fp32 to mixed-bf16"),
        ("    raise ValueError(", "    return cur\n    ValueError(", "raise ValueError when even every lever"),
        ("        if fits(cur):\n            return cur\n", "", "stop at the first config that fits"),
        ("cur = cur.replace(**change)", "cur = cfg.replace(**change)", "keep each lever once applied"),
    ],
}


def _conv_profiled(rank, world):
    """REFERENCE rank: a Chrome trace of two conv-net steps marked "labkit step 3/4" (the profiler's log muted)."""
    import json
    import os
    import tempfile
    from pathlib import Path

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    torch.manual_seed(5)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(3136, 4))
    x = torch.randn(8, 3, 16, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(2):
            with record_function(f"labkit step {i + 3}"):
                conv(x).sum().backward()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(str(Path(tmp) / "t.json"))
        return json.loads((Path(tmp) / "t.json").read_text())


@case("top_bottleneck", points=1)
def real_conv_trace_with_labkit_step_marks(student):
    from labkit.profiling.traces import top_ops

    trace = trusted_spawn(_conv_profiled, world=1, timeout=300)[0]
    rows = {r["name"]: r["self_ms"] for r in top_ops(trace, 1000)}
    got = student.call(trace, returns=str)
    assert got in rows and rows[got] >= 0.99 * max(rows.values()), got


@case("top_bottleneck", points=1)
def the_traps_together(student):
    from labkit.profiling.traces import top_ops

    events = [e for trace, *_ in visible.TRAPS for e in trace["traceEvents"] if e["cat"] != "user_annotation"]
    trace = visible._steps(*events)
    assert student.call(trace, returns=str) == top_ops(trace, 1)[0]["name"]


@case("peak_cause", points=1)
def the_first_of_two_equal_peaks(student):
    tie = visible._timeline([100, 0, 10, 0, 500, 0, 0, 0], [100, 0, 10, 0, 0, 0, 0, 0],
                            [100, 0, 10, 0, 0, 500, 0, 0])
    assert student.call(tie, returns=(str, float)) == ("activation", 610)
    mix = visible._timeline([5, 1, 0, 0, 0, 0, 0, 9], [40, 2, 7, 30, 0, 0, 3, 1], [40, 50, 7, 0, 0, 0, 3, 0])
    assert student.call(mix, returns=(str, float)) == ("optimizer state", 100)


def _fix(cfg, capacity):
    """The grader's own answer: the changed fields, or "ValueError" (the docstring's levers, in its order)."""
    import dataclasses

    from labkit.memory.estimate import estimate

    def fits(c):
        return estimate(c).fits(capacity)

    cur = cfg
    for change in (dict(precision="mixed-bf16") if cfg.precision == "fp32" else None,
                   dict(checkpointing="full") if cfg.batch else None,
                   dict(zero=3) if cfg.dp > 1 and cfg.zero < 3 else None,
                   dict(optimizer="adamw-8bit") if cfg.optimizer == "adamw" else None):
        if fits(cur):
            break
        cur = cur.replace(**change) if change else cur
    else:
        batch = cfg.batch or 1
        cur = next((cur.replace(grad_accum=d) for d in range(1, batch + 1) if batch % d == 0
                    and fits(cur.replace(grad_accum=d))), None)
    if cur is None:
        return "ValueError"
    return {f.name: getattr(cur, f.name) for f in dataclasses.fields(cur) if getattr(cur, f.name) != getattr(cfg, f.name)}


@case("fix_oom", points=2)
def more_models_layouts_and_batches(student):
    from labkit.memory.estimate import MemoryConfig

    for cfg, capacity in ((MemoryConfig(model="tiny-llama", precision="fp32", batch=64, seq=256), 3e6),
                          (MemoryConfig(model="llama3.2-1b", batch=16, seq=2048, dp=2), 24e9),
                          (MemoryConfig(model="llama3.2-1b", precision="fp32", batch=12, seq=2048), 24e9)):
        want = reference(_fix, cfg, capacity)
        visible.check_fix(student, cfg, capacity, ValueError if want == "ValueError" else want)
