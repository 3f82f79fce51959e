"""The hang-debugging demo (labkit.profiling.hangdemo): one rank skips a collective, the launcher's timeout stops
every rank, and each rank's faulthandler dump says where it waited."""
from __future__ import annotations

import re

import psutil
import pytest

from labkit.profiling import hangdemo

DUMP = """rank 0 pid 4242 started
Timeout (0:00:02)!
Thread 0x00007fe41a68cb80 (most recent call first):
  File "/venv/torch/distributed/distributed_c10d.py", line 3913 in all_reduce
  File "/venv/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/src/labkit/hangdemo.py", line 46 in log_loss
  File "/src/labkit/hangdemo.py", line 39 in train
  File "/src/labkit/hangdemo.py", line 66 in main
  File "/src/labkit/hangdemo.py", line 92 in <module>
"""


def test_stuck_frames_reads_each_ranks_dump(tmp_path):
    folder = tmp_path / "run_x" / "attempt_0"
    (folder / "0").mkdir(parents=True)
    (folder / "1").mkdir()
    (folder / "0" / "stderr.log").write_text(DUMP)
    (folder / "1" / "stderr.log").write_text("rank 1 pid 4243 started\n")  # finished: no dump
    got = hangdemo.stuck_frames(tmp_path)
    assert list(got) == [0]
    assert got[0]["func"] == "all_reduce" and got[0]["caller"] == "hangdemo.py:46 in log_loss"
    assert got[0]["stack"][-3:] == ["log_loss", "wrapper", "all_reduce"]


@pytest.mark.slow
def test_skipped_collective_hangs_until_the_launcher_stops_every_rank(tmp_path):
    from labkit.runtime import launch
    from labkit.errors import LaunchError

    # the hang's clock starts when both ranks are up: a busy machine's slow `import torch` does not count
    with pytest.raises(LaunchError, match="did not finish within hang_timeout_s=5 s after its 2 rank") as info:
        launch.run("labkit.profiling.hangdemo", ["--dump-after", "60"], nproc=2, timeout_s=600, hang_timeout_s=5,
                   log_dir=str(tmp_path), stream=False)
    assert "step 1: mean loss" in info.value.output  # it ran, then hung
    frames = hangdemo.stuck_frames(tmp_path)
    assert frames[0]["func"] == "all_reduce" and "log_loss" in frames[0]["caller"]  # rank 0 waits for rank 1
    assert frames[1]["func"] == "barrier"  # rank 1 skipped it and waits at the end of the run
    pids = [int(m) for p in tmp_path.rglob("stderr.log") for m in re.findall(r"pid (\d+) started", p.read_text())]
    assert len(pids) == 2 and not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


def test_a_hang_clock_needs_seconds_and_rank_ready_outside_a_launch_does_nothing(monkeypatch, tmp_path):
    from labkit.runtime import launch
    from labkit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"hang_timeout_s=0: give seconds > 0"):
        launch.run("labkit.profiling.hangdemo", [], nproc=2, hang_timeout_s=0)
    monkeypatch.delenv(launch.READY_ENV, raising=False)
    launch.rank_ready()
    monkeypatch.setenv(launch.READY_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    launch.rank_ready()
    assert [p.name for p in tmp_path.iterdir()] == ["1"]
