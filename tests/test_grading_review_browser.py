"""The TA's marking notebook works in a browser (issue #40 item 5): JupyterLab in headless Chromium.

`labkit grade` grades three free-text answers (tests/test_grading_manual.py's class), `labkit grade review
OUT` writes OUT/review.ipynb; JupyterLab serves OUT, Playwright runs its cell, types points and a comment for
the first answer, and marks.json must hold them; the next `labkit grade` puts them into grades.csv and the
student's feedback. Skipped, with the reason, only where Chromium or Playwright is not installed.
"""
from __future__ import annotations

import json
import time

import pytest

from labkit.course.grading.batch import GradeOptions, run_batch
from test_grading_manual import QUESTION, _cli, _grades, graded  # noqa: F401 (fixture)
from test_widgets_browser import CHROMIUM, STEP_S, jupyterlab, page  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")]


def _marks(path) -> dict:
    try:
        return {m["student"]: m for m in json.loads(path.read_text())["marks"]}
    except (OSError, ValueError, KeyError):
        return {}


def test_a_ta_marks_an_answer_in_jupyterlab_and_the_next_grade_uses_it(graded, page):  # noqa: F811
    subs, out = graded
    run_batch(subs, out, GradeOptions())
    assert _cli(["grade", "review", str(out)]) == 0
    with jupyterlab(out) as (base, token):
        page.goto(f"{base}/lab/tree/review.ipynb?token={token}")
        # The kernel is up before the cell runs: a keystroke that meets JupyterLab's start-up is lost.
        page.locator(".jp-StatusBar-TextItem", has_text="| Idle").first.wait_for()
        code = page.locator(".jp-CodeCell", has_text="review_widget(").first
        code.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Control+Enter")
        cell = code.locator(".jp-OutputArea")
        points = cell.locator(".widget-inline-hbox", has_text="points").locator("input").first
        points.wait_for()
        assert "<script>alert(1)</script> because" in cell.inner_text()  # the student's text, shown as text
        points.fill("2")
        points.press("Enter")
        comment = cell.locator(".widget-textarea textarea").first
        comment.fill("Good: the memory per GPU decides.")
        comment.press("Tab")
        deadline = time.monotonic() + STEP_S  # the condition: the kernel saved both (not a timing claim)
        while _marks(out / "marks.json").get("ann", {}).get("comment") != "Good: the memory per GPU decides.":
            assert time.monotonic() < deadline, f"marks.json: {_marks(out / 'marks.json')}"
            time.sleep(0.2)
    assert _marks(out / "marks.json")["ann"]["points"] == 2.0
    run_batch(subs, out, GradeOptions())
    assert _grades(out)["ann"][f"t_manual: {QUESTION}"] == "2" and _grades(out)["ann"]["score"] == "3"
    assert "Good: the memory per GPU decides." in (out / "feedback" / "ann.html").read_text()
