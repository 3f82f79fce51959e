"""The launcher's process tests hold on a busy machine: they run again while CPU hogs run.

`make test` shares a 2-core machine with other work; the interrupt, kill and two-node tests used to
fail there (leftover processes at a fixed-time check). This reruns them under one busy-loop process
per core, each stopping itself after a bounded time even if this test is killed.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import TESTS_DIR

#: This file tests the launch students get: ranks start cold (tests/conftest.py `_cold_ranks`).
COLD_RANKS = True

#: 1, not 2 (once 5): the hogs burn both cores for the whole run and slow everything else the suite runs
#: meanwhile. Every race here is run twice per `make test` anyway: once under the hogs, once in
#: test_launch.py itself under the suite's own load (2 workers busy); LABKIT_LAUNCH_REPEAT reruns more.
ROUNDS = 1
HOG_S = 600  # upper bound on a hog's life if nothing stops it
SELECTION = "keyboard_interrupt or killed_launcher or two_nodes"


@pytest.fixture
def cpu_hogs():
    code = f"import time\nend = time.monotonic() + {HOG_S}\nwhile time.monotonic() < end:\n    pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(os.cpu_count() or 1)]
    yield hogs
    for hog in hogs:
        hog.kill()
        hog.wait()


@pytest.mark.slow
def test_launcher_tests_pass_repeatedly_under_cpu_load(cpu_hogs, tmp_path):
    assert all(h.poll() is None for h in cpu_hogs), "the hogs should be running"
    env = {**os.environ, "LABKIT_LAUNCH_REPEAT": str(ROUNDS)}
    proc = subprocess.run([sys.executable, "-m", "pytest", str(TESTS_DIR / "test_launch.py"), "-q", "-x",
                           "-p", "no:cacheprovider", "-k", SELECTION, "--basetemp", str(tmp_path / "t")],
                          env=env, capture_output=True, text=True, cwd=TESTS_DIR.parent)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{3 * ROUNDS} passed" in proc.stdout, proc.stdout[-2000:]
    assert all(h.poll() is None for h in cpu_hogs), "the load must last for the whole run"
