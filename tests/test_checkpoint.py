"""Checkpoint / resume: SIGKILL mid-run then --resume equals an uninterrupted run; deadlines stop cleanly."""
from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from labkit import results
from labkit.errors import ConfigError
from labkit.zoo.models import llm_config
from labkit.train import loop, run  # noqa: F401  (imported up front: deadlines below are seconds away)
from labkit.train.checkpoint import complete_checkpoints, latest_checkpoint

REF_STEPS = 24
EVERY = 3


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run without checkpoints (saving must not change the losses either)."""
    llm_config("tiny-llama")  # warm the transformers import before any timed test
    return run("single", "tiny-llama", steps=REF_STEPS, out=str(tmp_path_factory.mktemp("ref")), progress=False)


def _wait_for_checkpoint(out: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    end = time.monotonic() + timeout_s
    while not complete_checkpoints(out):
        assert proc.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < end, "no checkpoint appeared"
        time.sleep(0.02)


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted_run(reference, tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "labkit", "train", "--strategy", "single", "--model", "tiny-llama",
           "--steps", "100000", "--checkpoint-every", str(EVERY), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_checkpoint(out, proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "results.jsonl").exists()  # really killed mid-run: no record was written
    saved = int(latest_checkpoint(out).name.split("_")[1])
    assert saved % EVERY == 0 and saved < REF_STEPS, f"killed too late (step {saved}) to compare"
    resumed = run("single", "tiny-llama", steps=REF_STEPS, out=str(out), resume=True,
                  checkpoint_every=EVERY, progress=False)
    assert resumed.train.resumed_from == saved
    np.testing.assert_allclose(resumed.losses, reference.losses, rtol=0, atol=1e-6)


def test_checkpoints_are_atomic_and_only_the_newest_two_are_kept(reference, tmp_path):
    out = tmp_path / "keep"
    run("single", "tiny-llama", steps=7, out=str(out), checkpoint_every=2, progress=False)
    assert [p.name for p in complete_checkpoints(out)] == ["step_4", "step_6"]
    meta = json.loads((out / "checkpoints" / "step_6" / "labkit.json").read_text())
    np.testing.assert_allclose(meta["losses"], reference.losses[:6], rtol=0, atol=1e-6)
    # A save killed half-way: a temp folder, or a step folder without labkit.json, is never resumed from.
    (out / "checkpoints" / ".tmp-step_8").mkdir()
    (out / "checkpoints" / "step_10").mkdir()
    assert latest_checkpoint(out).name == "step_6"
    resumed = run("single", "tiny-llama", steps=8, out=str(out), resume=True, checkpoint_every=2, progress=False)
    assert resumed.train.resumed_from == 6
    assert not (out / "checkpoints" / ".tmp-step_8").exists()
    np.testing.assert_allclose(resumed.losses, reference.losses[:8], rtol=0, atol=1e-6)
    assert len(results.load(out)) == 2  # appended, never overwritten


def test_a_fresh_run_never_mixes_with_an_earlier_runs_checkpoints(tmp_path):
    run("single", "tiny-llama", steps=3, out=str(tmp_path), checkpoint_every=2, progress=False)
    with pytest.raises(ConfigError, match="--resume"):
        run("single", "tiny-llama", steps=3, out=str(tmp_path), checkpoint_every=2, progress=False)
    with pytest.raises(ConfigError, match="batch=8 .* batch=16"):
        run("single", "tiny-llama", steps=4, out=str(tmp_path), batch=16, resume=True, progress=False)


def _in(seconds: float) -> str:
    return (dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=seconds)).isoformat()


@pytest.mark.slow
def test_deadline_checkpoints_and_stops_cleanly_before_it(reference, tmp_path):
    margin = 3.0
    deadline = _in(margin + 8)
    record = run("single", "tiny-llama", steps=1_000_000, out=str(tmp_path), deadline=deadline,
                 deadline_margin_s=margin, progress=False)
    left = (dt.datetime.fromisoformat(deadline) - dt.datetime.now(dt.timezone.utc)).total_seconds()
    assert left > 0  # returned before the deadline
    assert record.train.stopped == "deadline" and 0 < record.steps < 1_000_000
    assert latest_checkpoint(tmp_path).name == f"step_{record.steps}"
    n = min(record.steps, REF_STEPS)
    np.testing.assert_allclose(record.losses[:n], reference.losses[:n], rtol=0, atol=1e-6)


def test_a_past_or_too_close_deadline_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="has passed"):
        run("single", "tiny-llama", steps=2, out=str(tmp_path), deadline="2020-01-01T00:00:00+00:00")
    with pytest.raises(ConfigError, match="only .* s away, within the 60 s safety margin"):
        run("single", "tiny-llama", steps=2, out=str(tmp_path), deadline=_in(30))
    with pytest.raises(ConfigError, match="no UTC offset"):
        run("single", "tiny-llama", steps=2, out=str(tmp_path), deadline="2030-01-01T00:00:00")
    assert not os.listdir(tmp_path)
