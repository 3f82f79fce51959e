"""labkit.runtime.rank_pool: warm ranks serve run after run, and keep every promise of a cold launch.

Jobs are tests/_launch_targets.py's `parse_job` modes, on 2 gloo ranks; the last test trains for real
(ddp, fsdp-hybrid with its 2-D mesh, DeepSpeed ZeRO-2 twice) through `labkit.train.run`.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from conftest import TESTS_DIR, live_children
from labkit.runtime import rank_pool
from labkit.errors import LaunchError
from test_launch import GONE_S, SLOW_S, clock_starts_when_hanging, running, wait_for

TARGET = "_launch_targets"
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))}

pytestmark = pytest.mark.slow
#: The pool's process tree as users get it: torchrun and ranks start cold (tests/conftest.py `_cold_ranks`).
COLD_RANKS = True


@pytest.fixture(autouse=True)
def warm(monkeypatch):
    """Warm ranks on (pytest is not a kernel); no pool outlives its test."""
    monkeypatch.setenv(rank_pool.ENV_SWITCH, "1")
    yield
    pids = rank_pool.current_pids()
    rank_pool.close_pool()
    wait_for(lambda: not [p for p in pids if running(p)] and not live_children(), GONE_S,
             f"warm ranks left after close_pool: {[p for p in pids if running(p)]}")


def job(mode: str, tag: str = "", env: dict | None = None, timeout_s: float = SLOW_S):
    return rank_pool.run(TARGET, [mode, tag], nproc=2, env=env or ENV, timeout_s=timeout_s, stream=False)


def gone(pids) -> bool:
    return not [p for p in pids if running(p)]


def test_runs_share_ranks_a_failure_or_another_environment_starts_a_fresh_pool_a_timeout_kills_it(tmp_path, monkeypatch):
    # one pool for several checks (each pool costs three Python processes importing torch)
    first = job("ok", "first")
    pids = rank_pool.current_pids()
    assert len(pids) == 3, "torchrun and two warm ranks"
    second = job("ok", "second")
    assert rank_pool.current_pids() == pids  # the same processes served both runs
    assert "rank 0 of 2: sum=3 first" in first.output and "rank 1" not in first.output
    assert "rank 0 of 2: sum=3 second" in second.output and "first" not in second.output
    before = job("state").output
    job("leak")  # a subgroup, an environment variable, torch's thread count and matmul precision
    after = job("state").output
    assert "leak=None" in after and after.split("groups=")[1] == before.split("groups=")[1], (before, after)
    with pytest.raises(LaunchError) as info:
        job("raise")
    err = info.value
    assert err.rank == 1 and "ValueError: rank 1 exploded on purpose" in err.traceback
    wait_for(lambda: gone(pids), GONE_S, "the failed pool's processes are still running")
    assert "sum=3" in job("ok").output
    fresh = rank_pool.current_pids()
    assert fresh and not set(fresh) & set(pids)
    # Another environment gets another pool (the fresh one above serves as the old pool: one pool fewer);
    # then a timeout kills it, its clock started once rank 1 of `hang` ignores SIGTERM.
    hang_env = {**ENV, "DS_ACCELERATOR": "cpu", "LABKIT_TEST_PID_DIR": str(tmp_path)}  # what a DeepSpeed run brings
    job("ok", env=hang_env)
    wait_for(lambda: gone(fresh), GONE_S, "the previous pool was not stopped")
    pids = rank_pool.current_pids()
    assert pids and not set(pids) & set(fresh)
    monkeypatch.setattr(rank_pool._Pool, "wait", clock_starts_when_hanging(rank_pool._Pool.wait, tmp_path))
    with pytest.raises(LaunchError, match=r"timeout_s=3 "):
        job("hang", env=hang_env, timeout_s=3)
    wait_for(lambda: gone(pids), GONE_S, "ranks outlived the timeout")




def start_kernel_like(code: str) -> subprocess.Popen:
    """A Python process that runs `code` on its main thread with SIGINT raising KeyboardInterrupt."""
    prelude = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code)],
                            env={**os.environ, **ENV, rank_pool.ENV_SWITCH: "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def until_line(proc: subprocess.Popen, prefix: str, what: str) -> None:
    """Read `proc`'s output up to a line starting with `prefix`; fail with what it printed if it ends first
    (pytest-timeout bounds a process that neither prints nor ends)."""
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith(prefix):
            return
    pytest.fail(f"{what}: the process ended (exit {proc.wait()}) after printing:\n{''.join(out)[-4000:]}")


def pool_below(proc: subprocess.Popen) -> list[int]:
    def ranks():
        return [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    wait_for(lambda: len(ranks()) >= 3 or proc.poll() is not None, SLOW_S, "the warm ranks did not start")
    assert proc.poll() is None, proc.communicate()[0]
    return ranks()


def test_interrupt_during_a_warm_run_kills_every_rank(tmp_path):
    env = {**ENV, "LABKIT_TEST_PID_DIR": str(tmp_path)}  # rank 1 of `hang` says there when it hangs
    proc = start_kernel_like(f"""
        from labkit.runtime import rank_pool
        rank_pool.run({TARGET!r}, ['ok'], nproc=2, stream=False, timeout_s=600, env={env!r})
        print('first done', flush=True)
        try:
            rank_pool.run({TARGET!r}, ['hang'], nproc=2, stream=False, timeout_s=600, env={env!r})
        except KeyboardInterrupt:
            print('interrupted', flush=True)
    """)
    try:
        pids = pool_below(proc)
        until_line(proc, "first done", "the first run did not finish")
        # Interrupt DURING the second run (its rank 1 hangs), not between the two: a loaded run once sent
        # SIGINT before the caller reached its `try:`
        wait_for(lambda: (tmp_path / "hanging").exists() or proc.poll() is not None, SLOW_S,
                 "the second run's rank 1 did not start hanging")
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: proc.poll() is not None, GONE_S, "the caller did not return after SIGINT")
        assert "interrupted" in proc.communicate()[0]
        wait_for(lambda: gone(pids), GONE_S, f"ranks left after the interrupt: {[p for p in pids if running(p)]}")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_killed_caller_takes_its_idle_warm_ranks_with_it():
    proc = start_kernel_like(f"""
        import time
        from labkit.runtime import rank_pool
        rank_pool.run({TARGET!r}, ['ok'], nproc=2, stream=False, timeout_s=600, env={ENV!r})
        print('idle', flush=True)
        time.sleep(600)
    """)
    try:
        pids = pool_below(proc)
        until_line(proc, "idle", "the run did not finish")
    finally:
        proc.kill()  # SIGKILL, as a kernel restart: no atexit, no handler
        proc.wait()
    wait_for(lambda: gone(pids), GONE_S, f"idle warm ranks outlived their caller: {[p for p in pids if running(p)]}")


def test_training_runs_through_warm_ranks(tmp_path):
    """Real runs: subgroups of fsdp-hybrid are gone before the next run; two DeepSpeed runs in one pool
    (DeepSpeed's cached world clone is made again); each record is its own run's."""
    from labkit.train import run

    kw = dict(profile="smoke", nproc=2, steps=2, out=str(tmp_path / "runs"), stream=False)
    ddp = run("ddp", "tiny-llama", **kw)
    pids = rank_pool.current_pids()
    hybrid = run("fsdp-hybrid", "tiny-llama", **kw)
    again = run("ddp", "tiny-llama", **kw)
    assert rank_pool.current_pids() == pids
    assert again.losses == ddp.losses and hybrid.strategy == "fsdp-hybrid"
    z1 = run("zero2", "tiny-llama", **kw)
    z2 = run("zero2", "tiny-llama", **kw)
    assert z1.losses == z2.losses and z1.train.run_id != z2.train.run_id
