"""Warm rank starts (warmstart.rank_zygote): a rank forked from a zygote is the process a cold rank is, its shim
passes signals on and gives back its exit status, and nothing outlives what it belongs to.

Most tests drive the shim directly (`python -m labkit.runtime.rank_guard _zygote_targets MODE`, as torchrun starts a
rank) against a manager of their own whose zygotes preload nothing (cheap); the last goes through torchrun
with the suite's own manager (tests/conftest.py `_warm_rank_starts`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import TESTS_DIR, live_children
from warmstart import rank_zygote, run_command
from labkit.errors import LaunchError

REPO = TESTS_DIR.parent
pytestmark = pytest.mark.slow  # starts processes


@pytest.fixture
def manager(tmp_path):
    path = str(tmp_path / "manager.sock")
    proc = rank_zygote.start_manager(path, max_zygotes=1, preload=())
    yield path, proc
    rank_zygote.stop_manager(proc)


def shim(path: str | None, *args: str, cwd: Path, **env: str) -> subprocess.Popen:
    """A rank as torchrun starts it (own session, `python -u -m labkit.runtime.rank_guard ...`), warm when `path`."""
    full = {k: v for k, v in os.environ.items() if k != rank_zygote.SWITCH_ENV}
    full.update(PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS_DIR)]), RANK="0", **env)
    if path:
        full[rank_zygote.SWITCH_ENV] = path
    return subprocess.Popen([sys.executable, "-u", "-m", "labkit.runtime.rank_guard", "_zygote_targets", *args], env=full,
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(path: Path, proc: subprocess.Popen) -> None:
    """Until `path` exists (the rank wrote it) -- or the process ended without writing it."""
    while not path.exists():
        assert proc.poll() is None, f"{proc.args} ended ({proc.returncode}) before writing {path}: {proc.communicate()}"
        psutil.wait_procs([psutil.Process(proc.pid)], timeout=0.05)


def test_exit_statuses_come_back_as_the_rank_left(manager, tmp_path):
    path, _ = manager
    results = {mode: shim(path, mode, cwd=tmp_path) for mode in ("exit3", "raise", "killed")}
    outputs = {mode: proc.communicate(timeout=300) for mode, proc in results.items()}
    assert results["exit3"].returncode == 3
    assert results["raise"].returncode == 1
    assert "ValueError: a rank exploded on purpose" in outputs["raise"][1]  # the traceback, on the rank's stderr
    assert results["killed"].returncode == -signal.SIGKILL


def test_a_forked_rank_sees_what_a_cold_rank_sees(manager, tmp_path):
    path, proc = manager
    seen = {}
    for kind, where in (("cold", None), ("warm", path)):
        rank = shim(where, "describe", cwd=tmp_path, LABKIT_EXTRA="x")
        out, err = rank.communicate(timeout=300)
        assert rank.returncode == 0, err
        seen[kind] = dict(json.loads(out), shim=rank.pid)
    cold, warm = seen["cold"], seen["warm"]
    assert cold["pid"] == cold["shim"] and cold["ppid"] == os.getpid()  # cold: the shim is the rank itself
    assert warm["pid"] != warm["shim"] and warm["ppid"] in rank_zygote.resident_pids(proc)  # forked by a zygote
    for key in ("name", "argv", "cwd", "path0", "session_leader", "stdin_tty", "stdout_write_through"):
        assert warm[key] == cold[key], key
    assert warm["env"].pop(rank_zygote.SWITCH_ENV) == path
    assert warm["env"] == cold["env"]


def test_signals_are_passed_on_and_a_killed_shim_takes_its_rank_down(manager, tmp_path):
    path, _ = manager
    rank = shim(path, "wait", str(tmp_path), cwd=tmp_path)
    wait_for(tmp_path / "0.pid", rank)
    rank.send_signal(signal.SIGTERM)  # what torchrun and labkit.runtime.launch.kill_tree send
    assert rank.wait(timeout=300) == 0
    assert (tmp_path / "0.term").read_text() == "SIGTERM"  # the rank's own handler ran

    (tmp_path / "0.pid").unlink()
    rank = shim(path, "wait", str(tmp_path), cwd=tmp_path)
    wait_for(tmp_path / "0.pid", rank)
    forked = psutil.Process(json.loads((tmp_path / "0.pid").read_text())["pid"])
    rank.kill()  # SIGKILL: nothing to pass on; the rank sees its shim's connection close
    rank.wait()
    gone, alive = psutil.wait_procs([forked], timeout=300)
    assert not alive


def test_an_evicted_zygote_finishes_its_ranks_before_it_exits(manager, tmp_path):
    path, proc = manager  # max_zygotes=1: a second environment retires the first zygote
    first = shim(path, "wait", str(tmp_path), cwd=tmp_path, LABKIT_TEST_KEY="a", HF_HOME=str(tmp_path / "a"))
    wait_for(tmp_path / "0.pid", first)
    other = shim(path, "describe", cwd=tmp_path, HF_HOME=str(tmp_path / "b"))
    out, err = other.communicate(timeout=300)
    assert other.returncode == 0, err
    assert first.poll() is None  # still running in its retired zygote
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=300) == 0


def test_without_a_manager_the_rank_starts_cold(tmp_path):
    rank = shim(str(tmp_path / "no-such.sock"), "describe", cwd=tmp_path)
    out, err = rank.communicate(timeout=300)
    assert rank.returncode == 0, err
    assert json.loads(out)["pid"] == rank.pid


def test_the_graders_sandbox_never_forks_from_the_suites_zygote(tmp_path, monkeypatch):
    from labkit.course.grading import sandbox
    from labkit.runtime import hooks

    monkeypatch.setenv(rank_zygote.SWITCH_ENV, str(tmp_path / "manager.sock"))
    assert os.environ[hooks.ENV].endswith(":warmstart.hook")  # tests/conftest.py installed it
    env = sandbox.scratch_env(tmp_path)
    assert hooks.ENV not in env  # without the hook nothing reads the manager's socket: every start is cold


def test_commands_other_than_torchrun_stay_as_they_are():
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "x"]
    assert rank_zygote.warm_command(torchrun, {rank_zygote.SWITCH_ENV: "/s"}) == \
        [sys.executable, *run_command("warmstart.rank_zygote"), "run", "torch.distributed.run", "--nproc-per-node", "2",
         "-m", "x"]
    assert rank_zygote.warm_command(torchrun, {}) == torchrun
    other = [sys.executable, "-m", "accelerate.commands.launch", "x.py"]
    assert rank_zygote.warm_command(other, {rank_zygote.SWITCH_ENV: "/s"}) == other


def test_torchrun_and_its_ranks_fork_warm_and_a_timeout_stops_ranks_first(tmp_path):
    from conftest import _RANK_MANAGER
    from labkit.runtime import launch

    assert os.environ.get(rank_zygote.SWITCH_ENV) and _RANK_MANAGER, "tests/conftest.py starts the suite's manager"
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS_DIR)])}
    with pytest.raises(LaunchError, match="did not finish"):
        launch.run("_zygote_targets", ["wait", str(tmp_path)], nproc=2, env=env, timeout_s=600, hang_timeout_s=1,
                   stream=False)
    zygotes = rank_zygote.resident_pids(_RANK_MANAGER[0])
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"{rank}.pid").read_text())
        assert seen["ppid"] in zygotes and seen["torchrun_ppid"] in zygotes  # both forked warm
        assert (tmp_path / f"{rank}.term").read_text() == "SIGTERM"  # kill_tree found them and SIGTERMed them
    assert not live_children()
