"""Visible tests of notebook 08's exercises: reading a profiler trace and a memory timeline (made
here, on CPU, by torch.profiler around two steps of a small model) and fixing an OOM."""
import functools
import json
import tempfile
import warnings
from pathlib import Path

from labkit.course.exercises import case

#: LEGACY: these exercises' tests still run in the student's process; port them to `student.call /
#: run / spawn` (docs/grading.md, "Porting a legacy exercise") and remove their names here.
LEGACY = {"top_bottleneck", "peak_cause", "fix_oom"}


@functools.lru_cache(maxsize=1)
def _profiled():
    """(trace dict, memory timeline [times, sizes]) of two training steps of a small MLP on CPU."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

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


@case("top_bottleneck", points=2)
def top_bottleneck_names_the_op_with_most_self_time(top_bottleneck):
    from labkit.profiling.traces import top_ops

    trace, _ = _profiled()
    got = top_bottleneck(trace)
    rows = {r["name"]: r["self_ms"] for r in top_ops(trace, 1000)}
    best = max(rows.values())
    assert got in rows, f"{got!r} is not an op of the traced steps (the training thread's cpu_op events)"
    assert rows[got] >= 0.99 * best, (f"{got!r} has {rows[got]:.2f} ms of self time in the steps; "
                                      f"{max(rows, key=rows.get)!r} has {best:.2f} ms")


@case("peak_cause", points=2)
def peak_cause_reads_the_timeline(peak_cause):
    from labkit.profiling.traces import MEMORY_CATEGORIES

    _, timeline = _profiled()
    times, sizes = timeline
    totals = [sum(row[1:]) for row in sizes]
    i = totals.index(max(totals))
    by_cat = dict(zip(MEMORY_CATEGORIES, sizes[i][1:]))
    category, total = peak_cause(timeline)
    assert total == totals[i], f"peak total {total!r} != {totals[i]} bytes (the largest row sum of the categories)"
    assert by_cat.get(category) == max(by_cat.values()), (
        f"{category!r} is not the largest category at the peak: {by_cat}")


@case("fix_oom", points=3)
def fix_oom_fits_and_keeps_the_batch(fix_oom):
    from labkit.memory.estimate import MemoryConfig, estimate

    cfg = MemoryConfig(model="llama3.2-1b", precision="fp32", batch=32, seq=1024)
    cap = 40e9
    new = fix_oom(cfg, cap)
    assert isinstance(new, MemoryConfig), f"return a MemoryConfig (cfg.replace(...)), got {type(new).__name__}"
    est = estimate(new)
    assert est.fits(cap), f"estimated {est.total / 1e9:.1f} GB > {cap / 1e9:.0f} GB: it still does not fit"
    kept = ("model", "seq", "batch", "dp", "tp", "pp", "lora_rank", "quant", "offload")
    changed = [k for k in kept if getattr(new, k) != getattr(cfg, k)]
    assert not changed, f"changed {changed}: keep the model, the global batch and a full fine-tune"
    smaller = [d for d in range(1, new.grad_accum) if new.batch % d == 0]
    if smaller:
        assert not estimate(new.replace(grad_accum=smaller[-1])).fits(cap), (
            f"grad_accum={new.grad_accum} but {smaller[-1]} fits too: use the smallest that fits")
