"""The suite's own tools: scheduling units (tests/_schedule.py), the changed-tests selection
(tests/_changed.py) and the time-by-kind table (tests/_profile.py)."""
from __future__ import annotations

from conftest import TESTS_DIR


def test_files_sharing_the_sharding_sweep_are_one_unit_and_notebook_runs_are_their_own():
    from _schedule import file_groups, unit_of

    groups = file_groups(sorted(TESTS_DIR.glob("test_*.py")))
    sweep = {groups[name] for name in ("test_sharding_memory", "test_fsdp", "test_zero", "test_accelerate_fsdp")}
    assert len(sweep) == 1
    assert groups["test_budget"] == "test_budget"
    run = "tests/test_notebooks.py::test_notebook_runs_in_smoke_profile[notebooks/03_ddp.ipynb]"
    assert unit_of(run, groups) == run
    assert unit_of("tests/test_zero.py::test_x", groups) == sweep.pop()
    # each rehearsal and each exercise's mutant check is a unit: one file's 30 rehearsals on one worker took 20 min
    for case in ("tests/test_rehearsal.py::test_notebook_rehearses_on_the_profile[02_single_gpu-a100x4]",
                 "tests/test_exercises_ci.py::test_the_solution_passes_and_every_mutant_fails_a_test[03_ddp-bucket]"):
        assert unit_of(case, groups) == case
    assert unit_of("tests/test_rehearsal.py::test_a_bare_cuda_device_is_the_current_one", groups) == "test_rehearsal"


def test_changed_files_select_the_tests_that_import_them():
    from _changed import select

    files, stems = select(["notebooks/03_ddp.ipynb"])
    assert files == ["tests/test_exercises_ci.py", "tests/test_notebooks.py"] and stems == {"03_ddp"}
    files, _ = select(["labkit/runtime/rank_pool.py"])
    assert {"tests/test_launch_warm.py", "tests/test_train.py"} <= set(files)  # directly, and through labkit.train
    assert "tests/test_budget.py" not in files
    files, stems = select(["tests/_launch_targets.py"])
    assert files == ["tests/test_launch.py", "tests/test_launch_warm.py"] and not stems
    files, _ = select(["pyproject.toml"])
    assert "tests/test_packaging.py" in files


def test_profile_table_groups_tests_by_kind():
    from _profile import kind_of, table

    rows = [{"nodeid": "tests/test_notebooks.py::test_notebook_runs_in_smoke_profile[notebooks/a.ipynb]",
             "slow": True, "wall": 100.0, "cpu_self": 1.0, "cpu_children": 150.0, "procs": 9},
            {"nodeid": "tests/test_budget.py::test_x", "slow": False, "wall": 0.5, "cpu_self": 0.5,
             "cpu_children": 0.0, "procs": 0},
            {"nodeid": "tests/test_many.py::test_y", "slow": True, "wall": 30.0, "cpu_self": 2.0,
             "cpu_children": 30.0, "procs": 3}]
    assert [kind_of(r["nodeid"], r["slow"], r["procs"]) for r in rows] == [
        "notebook: smoke", "pure Python", "multi-process jobs (torchrun, spawn)"]
    text = table(rows)
    assert text.splitlines()[1].startswith("notebook: smoke") and "all tests" in text.splitlines()[-1]
    assert " 184 " in text.splitlines()[-1]  # CPU seconds summed over the tests and their processes
