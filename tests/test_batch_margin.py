"""02's largest batch (issue 38, G3): cuDNN's status errors near the limit count as out of memory in the
probes, the batch a later step runs at keeps a margin, and on a GPU the probes run in their own process."""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from labkit.train import batch_finder

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.mark.parametrize("message", ["cuDNN error: CUDNN_STATUS_INTERNAL_ERROR",
                                     "cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"])
def test_cudnn_status_errors_are_out_of_memory_only_in_probes(message):
    assert batch_finder.is_oom(RuntimeError(message), probing=True)
    assert not batch_finder.is_oom(RuntimeError(message))  # in a run, a bug to see


def test_a_probe_that_fails_in_cudnn_marks_the_boundary(monkeypatch):
    real = batch_finder._probe_hook

    def probe_hook(*args, **kwargs):
        cfg, hook = real(*args, **kwargs)
        step = hook.train_step

        def train_step(micro, loss_fn):
            if micro[0][0].shape[0] > 6:
                raise RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED")
            return step(micro, loss_fn)

        hook.train_step = train_step
        return cfg, hook

    monkeypatch.setattr(batch_finder, "_probe_hook", probe_hook)
    report = batch_finder.find_max_batch("tiny-llama", budget_mb=10_000, limit=64)
    assert report["max_micro_batch"] == 6 and report["safe_micro_batch"] == 4


def test_the_safe_batch_is_three_quarters():
    assert [batch_finder.safe_batch(b, 2) for b in (0, 2, 3, 8, 347)] == [0, 2, 2, 6, 260]


def test_notebook_02_runs_its_breakdown_at_the_safe_batch():
    nb = nbformat.read(NOTEBOOKS / "02_single_gpu.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells if "MEM_BATCH =" in c.source)
    assert 'report["safe_micro_batch"]' in cell and "max_micro_batch" not in cell


@pytest.mark.slow  # starts an interpreter
def test_isolated_probes_answer_as_in_process(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = batch_finder.find_max_batch("tiny-llama", budget_mb=2.5, limit=64, isolate=False)
    theirs = batch_finder.find_max_batch("tiny-llama", budget_mb=2.5, limit=64, isolate=True)
    assert theirs["max_micro_batch"] == mine["max_micro_batch"] > 0
    assert theirs["probes"] == json.loads(json.dumps(mine["probes"]))
