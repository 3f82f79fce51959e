"""The test suite's warm starts: torchrun, its ranks and notebook kernels forked from processes that
imported torch once (`rank_zygote`, `warm_kernels`, `forking`), installed into labkit through its one seam,
labkit.runtime.hooks, by tests/conftest.py (`LABKIT_TEST_HOOK=<tests/support>:warmstart.hook`)."""

import os
import sys
from pathlib import Path

HOOK = "warmstart.hook"
#: The folder that holds this package (tests/support).
SUPPORT = str(Path(__file__).resolve().parent.parent)


def install() -> None:
    """Make this package importable here and name its hook to labkit for every process started from here
    (tests/conftest.py; bench/warm_ranks.py and bench/warm_kernels.py)."""
    if SUPPORT not in sys.path:
        sys.path.insert(0, SUPPORT)
    os.environ["LABKIT_TEST_HOOK"] = f"{SUPPORT}:{HOOK}"  # found by a process whose PYTHONPATH a test replaced


def run_command(module: str) -> list[str]:
    """`-m MODULE` for `python`, found whatever the started process's PYTHONPATH (a test may replace it)."""
    return ["-c", f"import runpy, sys; sys.path.append({SUPPORT!r}); "
                  f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"]
