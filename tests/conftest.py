"""Shared test fixtures. Kept small: anything used by one test file lives in that file."""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The suite's warm starts (tests/support/warmstart) reach labkit through its one seam, labkit.runtime.hooks:
# importable here and in every process a test starts (ranks, kernels, the grader's children drop the hook).
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
import warmstart  # noqa: E402

warmstart.install()
# Tests run ranks and kernels on a shared 2-core machine: one thread each, no GUI backend.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
# Notebook kernels are forked from a zygote that imported torch and transformers once per environment
# (warmstart.warm_kernels: ~10 CPU s saved per kernel, ~70 kernels in make test); LABKIT_WARM_KERNELS=0
# runs every kernel cold, as a student's and the grader's are.
os.environ.setdefault("LABKIT_WARM_KERNELS", "1")
# torchrun's ranks are forked from a zygote that imported torch and transformers once per environment
# (warmstart.rank_zygote, started per pytest process by `_warm_rank_starts` below: ~8 CPU s saved per rank);
# LABKIT_RANK_ZYGOTE=0 starts every rank cold, as a student's and the grader's are. A test file that checks
# the cold launch itself sets COLD_RANKS = True.
_RANK_MANAGER: list = []
# labkit's cache (measured bandwidth / matmul efficiency, decoded images) is per test session: a file a
# developer's `labkit preflight` or `labkit bench comm` left in ~/.cache/labkit must not change results.
os.environ["LABKIT_CACHE"] = tempfile.mkdtemp(prefix="labkit-test-cache-")
atexit.register(shutil.rmtree, os.environ["LABKIT_CACHE"], ignore_errors=True)

TESTS_DIR = Path(__file__).resolve().parent
KERNEL = "labkit"


def pytest_addoption(parser):
    parser.addoption("--kind-profile", metavar="FILE", default=None,
                     help="append each test's wall/CPU seconds and processes to FILE (JSON lines) and print the "
                          "time by kind at the end (tests/_profile.py; `make test-profile`)")
    parser.addoption("--notebooks", metavar="STEMS", default=None,
                     help="comma-separated notebook names (03_ddp,...): deselect the notebook-parametrized tests of "
                          "every other notebook (`make test-changed`, tests/_changed.py)")


def pytest_configure(config):
    path = config.getoption("--kind-profile")
    if path:
        from _profile import KindProfile

        config.pluginmanager.register(KindProfile(Path(path).resolve()), "labkit-kind-profile")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test`'s units of work (tests/_schedule.py) for `--dist loadgroup`; xdist's own otherwise."""
    if config.getvalue("dist") == "loadgroup":
        from _schedule import make_scheduler

        return make_scheduler(config, log)
    return None


def pytest_collection_modifyitems(config, items):
    from _schedule import narrow_to_notebooks, schedule

    narrow_to_notebooks(config, items, TESTS_DIR.parent)
    schedule(config, items)


@pytest.fixture(scope="session", autouse=True)
def _warm_rank_starts():
    """One warmstart.rank_zygote manager for this pytest process (not for the xdist controller, which runs no
    test): every rank torchrun starts in a test, a notebook kernel or a warm pool forks from it."""
    from warmstart import rank_zygote

    if os.environ.get(rank_zygote.SWITCH_ENV) == "0":
        os.environ.pop(rank_zygote.SWITCH_ENV)
        yield
        return
    folder = tempfile.mkdtemp(prefix="labkit-rank-zygote-")
    path = os.path.join(folder, "manager.sock")
    _RANK_MANAGER.append(rank_zygote.start_manager(path))
    os.environ[rank_zygote.SWITCH_ENV] = path
    yield
    os.environ.pop(rank_zygote.SWITCH_ENV, None)
    rank_zygote.stop_manager(_RANK_MANAGER.pop())
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def cold_launch(monkeypatch):
    """This test's launches are a user's: no test hook (labkit.runtime.hooks), so torchrun and its ranks start
    cold, as on a node (tests/test_rehearsal.py runs every strategy module once this way)."""
    from labkit.runtime import hooks

    monkeypatch.delenv(hooks.ENV, raising=False)
    monkeypatch.delenv("LABKIT_RANK_ZYGOTE", raising=False)
    assert hooks.get("run_rank") is None and hooks.get("torchrun_command") is None
    yield


@pytest.fixture(autouse=True)
def _cold_ranks(request, monkeypatch):
    """A file with COLD_RANKS = True (the launcher's own tests) starts its ranks cold, as users' are."""
    if getattr(request.module, "COLD_RANKS", False):
        monkeypatch.delenv("LABKIT_RANK_ZYGOTE", raising=False)
    yield


@pytest.fixture
def run_cells(tmp_path):
    """Execute code cells in a fresh notebook on the `labkit` kernel; returns the executed notebook."""
    import nbclient
    import nbformat

    def execute(*sources: str, timeout: int = 120):
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": KERNEL, "display_name": "labkit (Python 3)", "language": "python"}
        nb.cells = [nbformat.v4.new_code_cell(src) for src in sources]
        from warmstart import warm_kernels

        client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=timeout,
                                         resources={"metadata": {"path": str(tmp_path)}},
                                         **warm_kernels.client_options())
        client.execute()
        return nb

    return execute


def stream_text(cell) -> str:
    """All stdout/stderr text a notebook cell printed."""
    return "".join(out.get("text", "") for out in cell.get("outputs", []) if out.get("output_type") == "stream")


def command_line(proc) -> str:
    """`proc`'s command line, or "" when it has exited: a child can end between `children()` and this read
    (seen in CI: accelerate's short-lived helper process), which must not fail the test that polls for ranks."""
    import psutil

    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def live_children() -> list:
    """This process's live descendants that a test may have left behind (zombies already reaped excluded).

    Python's multiprocessing resource tracker is not counted: `mp.spawn` (tests/_reference.py) starts it
    once per interpreter as a child of pytest, and it lives, idle, until pytest exits. It is Python's,
    not a labkit process, and no labkit code starts it. Nor are the warm-kernel zygotes (idle between
    notebooks, they live until pytest exits: warmstart.warm_kernels) and the rank-zygote manager with its
    zygotes (warmstart.rank_zygote); a kernel or a rank one forked is counted."""
    import psutil

    from warmstart import rank_zygote
    from warmstart import warm_kernels

    zygotes = set(warm_kernels.zygote_pids())
    for manager in _RANK_MANAGER:
        zygotes |= rank_zygote.resident_pids(manager)
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and child.pid not in zygotes and not any(
                    "multiprocessing.resource_tracker" in part for part in child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture
def warm_ranks(monkeypatch):
    """This test's `labkit.train.run` / `run_many` / `run_together` of 2 ranks go to warm ranks
    (`labkit.runtime.rank_pool`), which stay up for the next test of this worker that asks for them: only the
    first such run of a worker pays torchrun and two ranks importing torch and transformers (~25 CPU s).

    For tests that check a strategy's numbers, not the cold launch: `labkit.runtime.launch` keeps its own tests
    (test_launch.py), and labkit.train's cold launch stays tested wherever this fixture is not asked for
    (test_ddp, test_many, test_peft, ...). The pool dies with pytest (rank_pool's atexit and parent-death
    links), and before any test of a file that checks this process's children (`_no_idle_warm_ranks`)."""
    from labkit.runtime import rank_pool

    monkeypatch.setenv(rank_pool.ENV_SWITCH, "1")
    yield


@pytest.fixture(autouse=True)
def _no_idle_warm_ranks(request):
    """A file that checks this process's children (it imports `live_children`) starts its tests with no
    warm ranks left idle by an earlier test's `warm_ranks`."""
    import sys

    pool = sys.modules.get("labkit.runtime.rank_pool")
    if (pool is not None and "warm_ranks" not in request.fixturenames
            and getattr(request.module, "live_children", None) is live_children):
        pool.close_pool()
    yield
