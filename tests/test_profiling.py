"""Profiling: `labkit train --trace-steps N` leaves a trace, a memory timeline and a summary that says
where the time and the memory went."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from labkit.profiling import profiler as profiling
from labkit.errors import ConfigError
from labkit.train.api import make_config
from labkit.profiling.traces import CATEGORIES, load_trace, memory_peak, time_breakdown, top_ops

PNG = b"\x89PNG\r\n\x1a\n"
BIG = 8 * 2**20  # bytes of the tensor the in-process step allocates on purpose


# ------------------------------------------------------------------ the done criterion: DDP on 2 ranks
@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    from labkit import cli
    out = tmp_path_factory.mktemp("ddp-trace")
    argv = ["train", "--strategy", "ddp", "--model", "tiny-llama", "--profile", "smoke", "--nproc", "2",
            "--steps", "6", "--trace-steps", "2", "--out", str(out)]
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 0
    from labkit import results
    return out, results.load(out)[-1]


@pytest.mark.slow
def test_labkit_train_trace_steps_leaves_trace_and_memory_timeline(ddp_run):
    out, record = ddp_run
    traces = list(out.rglob("trace.json"))
    assert len(traces) == 1 and "traceEvents" in json.loads(traces[0].read_text())
    folder = traces[0].parent
    assert (folder / "memory_timeline.png").read_bytes()[:8] == PNG
    assert record.train.trace_steps == 2 and Path(record.train.profile_dir) == folder
    assert record.steps == 6  # the traced steps trained like the others


@pytest.mark.slow
def test_the_ddp_summary_finds_the_all_reduce_and_the_peak(ddp_run):
    out, _ = ddp_run
    folder = next(out.rglob("trace.json")).parent
    summary = profiling.summarize(folder)
    shares = summary.time["shares"]
    assert summary.time["steps"] == 2 and set(shares) == set(CATEGORIES)
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.02)
    assert shares["communication"] > 0 and shares["optimizer"] > 0 and shares["compute"] > 0
    names = {op["name"] for op in top_ops(load_trace(folder), 50)}
    assert "c10d::allreduce_" in names  # DDP's gradient bucket
    assert summary.peak["bytes"] > 0 and summary.peak["phase"] in ("forward", "backward", "optimizer")
    text = (folder / "summary.txt").read_text()
    assert "communication" in text and "peak memory" in text and "bottleneck:" in text
    # The categorized timeline worked for DDP: parameters and optimizer state were live at the peak.
    assert summary.peak["by_category"]["parameter"] > 0 and summary.peak["by_category"]["optimizer state"] > 0


# ------------------------------------------------------------------ in process: known time and memory
def _tiny_step(model, opt, batch, *, big: bool):
    x, y = batch
    opt.zero_grad(set_to_none=True)
    h = model(x)
    if big:  # a large temporary that is alive at the peak, allocated by aten::empty in forward
        scratch = torch.empty(BIG // 4)
        h = h + scratch[:1].zero_()
    torch.nn.functional.mse_loss(h, y).backward()
    opt.step()


@pytest.fixture(scope="module")
def local_trace(tmp_path_factory):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 1))
    batches = iter(torch.utils.data.DataLoader(data, batch_size=8))
    folder = tmp_path_factory.mktemp("local") / "profile"
    tracer = profiling.StepTracer(folder, range(2, 4), device=torch.device("cpu"), is_main=True, title="mlp")
    for local in range(5):
        tracer.before(local)
        _tiny_step(model, opt, next(batches), big=local == 3)
        tracer.after(local)
    return tracer.finish()


def test_a_local_trace_attributes_data_optimizer_and_no_communication(local_trace):
    time = time_breakdown(load_trace(local_trace.trace))
    assert time["steps"] == 2
    shares = time["shares"]
    assert shares["data loading"] > 0 and shares["optimizer"] > 0 and shares["compute"] > 0
    assert shares["communication"] == 0 and time["background_comm_share"] == 0


def test_the_peak_is_in_the_step_that_allocated_the_big_tensor_and_names_it(local_trace):
    peak = memory_peak(load_trace(local_trace.trace))
    assert peak["step"] == "4" and peak["bytes"] >= BIG
    biggest = peak["live"][0]
    assert biggest["bytes"] == BIG and biggest["op"] == "aten::empty" and biggest["phase"] == "forward"
    assert local_trace.memory_figure.read_bytes()[:8] == PNG
    assert "aten::empty" in local_trace.summary.read_text()


# ------------------------------------------------------------------ errors name the fix
def test_a_window_longer_than_the_run_is_a_config_error():
    with pytest.raises(ConfigError, match="use --steps >= 4"):
        make_config("single", "tiny-llama", steps=3, trace_steps=2)
    assert list(profiling.window(make_config("single", "tiny-llama", steps=4, trace_steps=2))) == [2, 3]


def test_nsys_needs_cuda_and_a_trace_needs_step_marks(tmp_path):
    with pytest.raises(ConfigError, match="--trace-with torch"):
        make_config("single", "tiny-llama", steps=6, trace_steps=2, trace_with="nsys")
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 0,
                                                                      "dur": 5, "tid": 1, "cat": "cpu_op"}]}))
    with pytest.raises(ConfigError, match="labkit step N"):
        profiling.summarize(tmp_path)
    with pytest.raises(ConfigError, match="--trace-steps 2"):
        profiling.summarize(tmp_path / "missing")
