"""How `make test` spreads the suite over 2 pytest-xdist workers (`-n 2 --dist loadgroup`), and `--notebooks`.

- Each test file is one unit of work (its module fixtures are built once), and files that import each
  other's fixtures are one unit together (tests/test_sharding_memory.py's shared sweep is read by
  test_fsdp, test_zero and test_accelerate_fsdp: one torchrun job for all four, on one worker).
- A notebook execution, a notebook's rehearsal on one GPU profile and one exercise's solution-and-mutants
  check are units of their own (SPLIT: cases that share nothing), so two workers run them side by side:
  as one file's unit, the 30 rehearsals alone kept one worker busy for 20 minutes.
- Units go out heaviest first (longest-processing-time first: no worker is left with one long unit
  while the other idles at the end); with `--no-loadscope-reorder` xdist keeps this order.
tests/conftest.py hands `make_scheduler` to xdist (`pytest_xdist_make_scheduler`) and calls `schedule`.
Weights are rough CPU costs (a notebook run ~ 100, a test marked slow ~ 15, any other ~ 0.3), enough to
order units; tests/_profile.py measures the real ones.
"""
from __future__ import annotations

import ast
from pathlib import Path


#: test function -> the rough CPU seconds of one case; each case is a unit of its own (no shared fixture).
SPLIT = {
    "test_notebook_runs_in_smoke_profile": 100.0,
    "test_notebook_rehearses_on_the_profile": 40.0,
    "test_the_solution_passes_and_every_mutant_fails_a_test": 25.0,
}
WEIGHTS = {"slow": 15.0, "other": 0.3}


def _split(nodeid: str) -> str | None:
    name = nodeid.split("::", 1)[-1].split("[", 1)[0]
    return name if name in SPLIT else None


def weight(item) -> float:
    if split := _split(item.nodeid):
        return SPLIT[split]
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


def unit_of(nodeid: str, groups: dict[str, str]) -> str:
    """The unit of work a test belongs to: itself for a SPLIT case, else its file's group."""
    if _split(nodeid):
        return nodeid
    file = nodeid.split("::", 1)[0]
    return groups.get(Path(file).stem, file)


def make_scheduler(config, log):
    """pytest-xdist's scheduler for `--dist loadgroup`, with our units (xdist's own xdist_group marks do
    not reach the controller under pytest 9: it renames `item._nodeid`, which pytest 9 no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    groups = file_groups(sorted(Path(__file__).resolve().parent.glob("test_*.py")))

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid, groups)

    return UnitScheduling(config, log)


def schedule(config, items: list) -> None:
    """In each pytest-xdist worker (the workers collect), order `items` heaviest unit first."""
    if not hasattr(config, "workerinput"):
        return
    groups = file_groups(sorted({Path(str(i.fspath)) for i in items if Path(str(i.fspath)).name.startswith("test_")}))
    units: dict[str, float] = {}
    for item in items:
        units[unit_of(item.nodeid, groups)] = units.get(unit_of(item.nodeid, groups), 0.0) + weight(item)
    items.sort(key=lambda item: -units[unit_of(item.nodeid, groups)])  # stable: a unit keeps its order


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
