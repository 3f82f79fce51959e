"""How `make test` spreads the suite over 2 pytest-xdist workers (`-n 2 --dist loadgroup`), and `--notebooks`.

- Each test file is one unit of work (its module fixtures are built once), and files that import each
  other's fixtures are one unit together (tests/test_sharding_memory.py's shared sweep is read by
  test_fsdp, test_zero and test_accelerate_fsdp: one torchrun job for all four, on one worker).
- A notebook execution is a unit of its own, so two workers run different notebooks side by side.
- Units go out heaviest first (longest-processing-time first: no worker is left with one long unit
  while the other idles at the end); with `--no-loadscope-reorder` xdist keeps this order.
Weights are rough CPU costs (a notebook run ~ 100, a test marked slow ~ 15, any other ~ 0.3), enough to
order units; tests/_profile.py measures the real ones.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

NOTEBOOK_RUN = "test_notebook_runs_in_smoke_profile"
WEIGHTS = {"notebook": 100.0, "slow": 15.0, "other": 0.3}


def weight(item) -> float:
    if NOTEBOOK_RUN in item.nodeid:
        return WEIGHTS["notebook"]
    return WEIGHTS["slow"] if item.get_closest_marker("slow") else WEIGHTS["other"]


def file_groups(test_files: list[Path]) -> dict[str, str]:
    """test file name -> its unit's name: files that import one another (`from test_x import ...`) share one."""
    parent = {p.stem: p.stem for p in test_files}

    def find(name: str) -> str:
        while parent[name] != name:
            name = parent[name]
        return name

    for path in test_files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module in parent:
                parent[find(node.module)] = find(path.stem)
    return {name: find(name) for name in parent}


def schedule(config, items: list) -> None:
    """Group and order `items` in each pytest-xdist worker (the workers collect; without `-n` nothing happens)."""
    if not hasattr(config, "workerinput"):
        return
    files = sorted({Path(str(item.fspath)) for item in items if Path(str(item.fspath)).name.startswith("test_")})
    groups = file_groups(files)
    units: dict[str, float] = {}
    for item in items:
        stem = Path(str(item.fspath)).stem
        if NOTEBOOK_RUN in item.nodeid or item.get_closest_marker("xdist_group") or stem not in groups:
            unit = item.nodeid
        else:
            unit = groups[stem]
            item.add_marker(pytest.mark.xdist_group(unit))
        item.stash[_UNIT] = unit
        units[unit] = units.get(unit, 0.0) + weight(item)
    items.sort(key=lambda item: -units[item.stash[_UNIT]])  # stable: a unit's tests keep their order


_UNIT = pytest.StashKey[str]()


def narrow_to_notebooks(config, items: list, root: Path) -> None:
    """`--notebooks a,b`: deselect the tests parametrized over any other notebook (tests/_changed.py)."""
    wanted = config.getoption("--notebooks")
    if not wanted:
        return
    stems = {p.stem for folder in ("notebooks", "reservations") for p in (root / folder).glob("*.ipynb")}
    keep = set(wanted.split(","))
    drop = [item for item in items if (named := {s for s in stems if s in item.nodeid}) and not named & keep]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if item not in drop]
