"""Checks of notebooks/00_setup.ipynb: the environment ran, and the lease plan was read correctly."""
from __future__ import annotations

from labkit.course.grading.checks import answer_close, cell_ran
from labkit.course.grading.evidence import CheckFailed, Evidence

NOTEBOOK = "00_setup"


def copy_off_minute(ev: Evidence) -> float:
    """Minute of a 3-hour a100x4 lease by which runs/ must be copied off (labkit.course.lease_timeline)."""
    from labkit.course.lease_timeline import plan_lease

    for step in plan_lease(3.0, "a100x4"):
        if step.what.startswith("copy off"):
            return float(step.end_min)
    raise CheckFailed("the lease plan has no copy-off step")  # a labkit bug, not the student's


CHECKS = (
    cell_ran("every cell ran without error", 1),
    answer_close("copy-off deadline of the 3-hour plan", 2, "00.copy_off_done_by_min", copy_off_minute,
                 rtol=0.0, atol=0.0),
)
