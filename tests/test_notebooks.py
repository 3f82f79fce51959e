"""Every committed notebook is clean and runs top to bottom in the smoke profile.

Parametrized over the notebooks that exist when pytest collects, so a notebook added to notebooks/
or reservations/ is covered without touching this file. Executed copies go to build/executed/
(reservations' to build/executed/reservations/), where the grading tests read them.
The GPU profiles' branches (bf16 and fp16 included) run in tests/test_rehearsal.py: every notebook
rehearsed for a100x4, h100x1 and v100x4. That replaced the smoke-bf16 notebook runs (CPU ranks in
bf16); what only they executed -- bf16 over real gloo ranks -- is
tests/test_rehearsal.py::test_every_strategy_a_lab_trains_in_bf16_communicates_over_real_ranks.
Also tests the lease plan that notebook 00_setup shows (labkit.course.lease_timeline).
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from labkit.course import lease_timeline as lp
from labkit.course import notebook_hygiene as hygiene
from labkit.course import notebooks as nbk
from labkit.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
EXECUTED = ROOT / "build" / "executed"
LAB_NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
ALL_NOTEBOOKS = LAB_NOTEBOOKS + sorted((ROOT / "reservations").glob("*.ipynb"))
# Only a notebook in reservations/ with {"labkit": {"execute_in_ci": false, "reason": ...}} is left out.
EXECUTED_IN_CI = [p for p in ALL_NOTEBOOKS if hygiene.executes_in_ci(p)]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_setup_notebook_exists():
    assert ROOT / "notebooks" / "00_setup.ipynb" in LAB_NOTEBOOKS


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=rel)
def test_notebook_hygiene(path):
    assert hygiene.check_hygiene(path) == [], f"{rel(path)}: fix these, or run `make clean-notebooks`"


@pytest.mark.slow
@pytest.mark.parametrize("path", EXECUTED_IN_CI, ids=rel)
def test_notebook_runs_in_smoke_profile(path):
    profile = "smoke"
    out = EXECUTED if path.parent.name == "notebooks" else EXECUTED / path.parent.name
    run = nbk.run_notebook(path, profile=profile, out_dir=out)
    assert run.output.is_file()
    if not run.ok:
        pytest.fail(f"{rel(path)} ({profile}): {run.describe()}\n{run.traceback[-4000:]}", pytrace=False)
    if path.stem == "02_single_gpu":
        check_02_precisions(run.output)
    if path.parent.name == "notebooks":
        # The solutions are the reference: the executed source gets full marks (issue #15). Its recorded checks
        # are graded here; the code tests of its exercise cells (the same source) run once, with their mutants,
        # in tests/test_exercises_ci.py.
        from labkit.course.exercises.grading import full_marks_problems

        assert full_marks_problems(run.output, code_tests=False) == [], f"{rel(path)} does not get full marks"


def check_02_precisions(executed: Path) -> None:
    """The 02 baseline is fp32 and the AMP run bf16 on every profile (the AMP speedup is fp32 vs bf16)."""
    from labkit.course.grading.evidence import Evidence

    ev = Evidence.from_notebook(nbformat.read(executed, as_version=4))
    dtypes = {key: ev.run(key).dtype for key in ("baseline", "accum", "checkpointing", "amp", "channels_last")}
    assert dtypes == {"baseline": "float32", "accum": "float32", "checkpointing": "float32",
                      "amp": "bfloat16", "channels_last": "bfloat16"}, dtypes


# ---------------------------------------------------------------- the CI exemption rule
def _exempt_notebook(folder: Path, meta: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "reserve.ipynb"
    nbformat.write(nbk.build_notebook("Reserve", ["import chi"], metadata={"labkit": meta}), path)
    return path


def test_reservation_notebook_with_a_reason_is_exempt(tmp_path):
    path = _exempt_notebook(tmp_path / "reservations", {"execute_in_ci": False, "reason": "needs python-chi login"})
    assert hygiene.check_hygiene(path) == []
    assert hygiene.ci_exemption(nbformat.read(path, as_version=4)) == "needs python-chi login"
    assert not hygiene.executes_in_ci(path)


def test_exemption_without_a_reason_is_refused(tmp_path):
    path = _exempt_notebook(tmp_path / "reservations", {"execute_in_ci": False})
    assert any('needs a "reason"' in p for p in hygiene.check_hygiene(path))
    assert hygiene.executes_in_ci(path)


def test_lab_notebooks_cannot_be_exempt(tmp_path):
    path = _exempt_notebook(tmp_path / "notebooks", {"execute_in_ci": False, "reason": "too slow"})
    assert any("only notebooks in reservations/" in p for p in hygiene.check_hygiene(path))
    assert hygiene.executes_in_ci(path)


def test_notebooks_without_the_flag_are_executed(tmp_path):
    assert hygiene.executes_in_ci(_exempt_notebook(tmp_path / "reservations", {"execute_in_ci": True}))
    assert all(p in EXECUTED_IN_CI for p in LAB_NOTEBOOKS)


# ---------------------------------------------------------------- the lease plan of 00_setup
def lab_steps(steps):
    return [s.what.split()[0] for s in steps if s.what[:2].isdigit()]


def check_timeline(steps, hours):
    end = int(hours * 60) - lp.END_EARLY_MIN  # leases end at :55
    assert steps[0].start_min == 0 and steps[-1].end_min == end
    assert all(a.end_min == b.start_min and a.start_min < a.end_min for a, b in zip(steps, steps[1:]))
    kinds = [s.what.split(":")[0] for s in steps]
    assert kinds[:3] == ["launch", "setup", "download"] and kinds[-3:] == ["save", "copy off", "margin"]
    assert steps[0].end_min == lp.LAUNCH_MIN  # the node's boot is on the lease clock
    copy = steps[-2]
    assert "rsync" in copy.what and "runs/" in copy.what
    # The labs write to runs/ beside the notebook (the default results root; `make lab` opens notebooks/), so
    # the copy takes notebooks/ -- the student's answers and their runs -- not a labkit/runs/ nobody writes.
    assert "labkit/notebooks/" in copy.what and "labkit/runs/" not in copy.what
    assert copy.end_min <= end - 10  # results are off the node 10+ minutes before the lease ends


def test_three_hour_plan_runs_every_lab_in_order_and_saves_in_time():
    steps = lp.plan_lease(3.0, "a100x4")
    check_timeline(steps, 3.0)
    assert lab_steps(steps) == ["02", "03", "04", "05", "06", "07", "08", "09"]
    assert all(isinstance(s, tuple) and len(s) == 4 for s in steps)  # (start_min, end_min, what, why)


def test_two_blocks_split_the_labs_by_gpu_count_and_overflow_to_an_overnight_block():
    blocks = lp.plan_two_blocks()
    (single_name, single), (multi_name, multi), (night_name, night) = blocks.items()
    assert "1x A100" in single_name and "4x" in multi_name and "overnight" in night_name
    for steps in (single, multi, night):
        check_timeline(steps, 2.0)
    assert lab_steps(single) == ["02", "06"]
    # launch + setup + downloads leave room for three of the six multi-GPU labs in a 2-hour block
    assert lab_steps(multi) + lab_steps(night) == ["03", "04", "05", "07", "08", "09"]
    assert lab_steps(multi) == ["03", "04", "05"]
    assert len(lp.plan_two_blocks(3.0)) == 2  # 3-hour blocks need no third


def test_plans_that_cannot_work_are_refused():
    with pytest.raises(ConfigError, match="plan_two_blocks"):
        lp.plan_lease(2.0, "a100x4")  # every lab does not fit in 2 hours
    with pytest.raises(ConfigError, match="needs 2\\+ GPUs"):
        lp.plan_lease(2.0, "a100x1", labs=["03_ddp"])
    with pytest.raises(ConfigError, match="GPU node"):
        lp.plan_lease(3.0, "smoke")
    with pytest.raises(ConfigError, match="valid labs are"):
        lp.plan_lease(3.0, "a100x4", labs=["09_magic"])


def test_format_plan_shows_clock_times():
    text = lp.format_plan(lp.plan_lease(3.0, "a100x4"), start="14:00")
    lines = text.splitlines()
    assert lines[0].startswith("14:00-14:10") and lines[-1].startswith("16:45-16:55")
    assert lp.format_plan(lp.plan_lease(3.0, "a100x4")).startswith("0:00-0:10")
    with pytest.raises(ConfigError, match="HH:MM"):
        lp.format_plan(lp.plan_lease(3.0, "a100x4"), start="2pm")
