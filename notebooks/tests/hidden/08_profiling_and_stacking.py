"""Hidden tests of notebook 08's exercises: hand-built traces / timelines where the tempting shortcut
(total instead of self time, the last or the globally largest row, ops outside the steps or on other
threads) gives another answer, a real trace marked like labkit's, and more OOM scenarios."""
import json
import tempfile
from pathlib import Path

from labkit.course.exercises import case

#: LEGACY: these exercises' tests still run in the student's process; port them to `student.call /
#: run / spawn` (docs/grading.md, "Porting a legacy exercise") and remove their names here.
LEGACY = {"top_bottleneck", "peak_cause", "fix_oom"}

MUTANTS = {
    "top_bottleneck": [('totals.get(e["name"], 0.0) + e["dur"] - child', 'totals.get(e["name"], 0.0) + e["dur"]')],
    "peak_cause": [("i = totals.index(max(totals))", "i = len(totals) - 1")],
    "fix_oom": [("dict(zero=3) if cfg.dp > 1 and cfg.zero < 3 else None", "None"),
                ("if fits(cur.replace(grad_accum=accum)):", "if accum == (cfg.batch or 1):")],
}


def _x(name, ts, dur, tid=1, cat="cpu_op"):
    return dict(ph="X", name=name, ts=ts, dur=dur, tid=tid, pid=1, cat=cat)


@case("top_bottleneck", points=2)
def self_time_not_total_time(top_bottleneck):
    events = [
        _x("aten::huge_before_steps", 0, 5000),
        _x("labkit step 3", 10000, 1000, cat="user_annotation"),
        _x("aten::linear", 10010, 500), _x("aten::addmm", 10020, 420),  # linear: total 500, self 80
        _x("aten::relu", 10600, 300), _x("<built-in method relu>", 10610, 290, cat="python_function"),
        _x("labkit step 4", 11000, 1000, cat="user_annotation"),
        _x("aten::linear", 11010, 500), _x("aten::addmm", 11020, 420),
        _x("aten::relu", 11600, 300),
        _x("aten::sum", 11950, 40),
        _x("gloo:all_reduce", 10000, 2000, tid=2),  # another thread
    ]
    got = top_bottleneck({"traceEvents": events})
    assert got == "aten::addmm", got
    events += [_x("aten::relu", 11300, 250)]  # relu now 300 + 300 + 250 self > addmm 840
    assert top_bottleneck({"traceEvents": events}) == "aten::relu"


@case("top_bottleneck", points=1)
def real_trace_with_labkit_step_marks(top_bottleneck):
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from labkit.profiling.traces import top_ops

    torch.manual_seed(5)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(4))
    x = torch.randn(8, 3, 16, 16)
    conv(x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(2):
            with record_function(f"labkit step {i + 3}"):
                conv(x).sum().backward()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(str(Path(tmp) / "t.json"))
        trace = json.loads((Path(tmp) / "t.json").read_text())
    rows = {r["name"]: r["self_ms"] for r in top_ops(trace, 1000)}
    got = top_bottleneck(trace)
    assert got in rows and rows[got] >= 0.99 * max(rows.values())


@case("peak_cause", points=2)
def peak_row_not_last_or_largest_cell(peak_cause):
    #            unused param  optim  input temp  act   grad  autograd unknown
    sizes = [[0, 100, 0, 10, 0, 0, 0, 0, 0],
             [0, 100, 0, 10, 5, 500, 0, 0, 0],       # the peak (615): activations
             [0, 100, 0, 10, 0, 50, 100, 0, 0],
             [0, 100, 380, 10, 0, 0, 100, 0, 0],     # largest single cell elsewhere; total 590
             [0, 100, 380, 10, 0, 0, 0, 0, 0]]
    times = [0, 10, 20, 30, 40]
    assert peak_cause([times, sizes]) == ("activation", 615)
    sizes[3][2] = 500  # now the optimizer step peaks (710), optimizer state dominates
    assert peak_cause([times, sizes]) == ("optimizer state", 710)


@case("fix_oom", points=2)
def fix_oom_more_scenarios(fix_oom):
    from labkit.memory.estimate import MemoryConfig, estimate

    def ok(cfg, cap):
        new = fix_oom(cfg, cap)
        assert estimate(new).fits(cap)
        for k in ("model", "seq", "batch", "dp", "lora_rank", "quant", "offload"):
            assert getattr(new, k) == getattr(cfg, k), k
        smaller = [d for d in range(1, new.grad_accum) if new.batch % d == 0]
        assert not smaller or not estimate(new.replace(grad_accum=smaller[-1])).fits(cap)
        return new

    assert ok(MemoryConfig(model="llama2-7b", dp=4, batch=8, seq=4096), 80e9).zero == 3  # only sharding helps
    ok(MemoryConfig(model="tiny-llama", precision="fp32", batch=64, seq=256), 3e6)  # needs many micro-batches
    fine = MemoryConfig(model="tinyllama-1.1b", batch=1, seq=512)
    assert fix_oom(fine, 80e9) == fine  # already fits: unchanged
    try:
        fix_oom(MemoryConfig(model="llama2-7b", batch=8, seq=4096), 8e9)
    except ValueError:
        return
    raise AssertionError("a 7B full fine-tune in 8 GB must raise ValueError")
