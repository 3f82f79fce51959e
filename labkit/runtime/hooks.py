"""The one seam where the test suite changes how labkit starts processes; nothing sets it for a student,
an instructor or the grader (its sandbox drops it: labkit.course.grading.sandbox).

`LABKIT_TEST_HOOK=[FOLDER:]package.module` names a module (FOLDER: appended to the import path first, so
a process started with its own PYTHONPATH still finds it) that labkit asks, where it defines them:
- `torchrun_command(cmd, env) -> cmd`: what starts torchrun (labkit.runtime.rank_guard.guarded);
- `run_rank(argv)`: run the rank elsewhere and end this process as it ended, or return to run it here
  (labkit.runtime.rank_guard.main);
- `process_tree(pid) -> (head, rest)`: the processes that stand for `pid` and its descendants
  (labkit.runtime.launch.kill_tree, labkit.runtime.rank_pool);
- `kernel_manager_class() -> class | None` and `reaped_cpu() -> float`: a notebook kernel's manager and the
  CPU seconds of kernels it reaped that were not this process's children (labkit.course.notebooks).
`make test` installs tests/support/warmstart/hook.py (torchrun, its ranks and notebook kernels forked from a
process that imported torch once). Without the variable, or when its module cannot be imported, every
answer is labkit's own: the cold launch a user gets.
"""
from __future__ import annotations

import importlib
import os
import sys
from functools import lru_cache

ENV = "LABKIT_TEST_HOOK"


@lru_cache(maxsize=4)
def _module(spec: str):
    folder, _, name = spec.rpartition(":")
    if folder and folder not in sys.path:
        sys.path.append(folder)
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def get(function: str, env=None):
    """The hook's `function`, or None (no hook named in `env`, default ours, or it does not define it)."""
    name = (os.environ if env is None else env).get(ENV)
    module = _module(name) if name else None
    return getattr(module, function, None) if module is not None else None


def process_tree(pid: int) -> tuple[list, list]:
    """([process `pid`], [its descendants]) as the hook sees them, else as psutil does."""
    hook = get("process_tree")
    if hook is not None:
        return hook(pid)
    import psutil

    try:
        head = psutil.Process(pid)
        return [head], head.children(recursive=True)
    except psutil.NoSuchProcess:
        return [], []
