"""The gradebook's columns (issue #40 item 4): points per check and per exercise test, from the grader's plan.

Recorded-results batches of hand-sealed lab-01 notebooks (tests/test_grading_shards.py): nothing executes.
"""
from __future__ import annotations

import csv
from pathlib import Path

import nbformat

from labkit.course.grading import gradebook, questions
from labkit.course.grading.batch import GradeOptions, run_batch
from labkit.course.grading.checks import CheckResult
from labkit.course.grading.evaluate import Grade
from labkit.course.grading.nb_checks.lab01_memory import zero3_7p5b_64
from labkit.course.grading.registry import checks_for
from test_grading_shards import _lab01


def _csv(path: Path) -> list[dict]:
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_grades_csv_has_the_points_of_every_check_and_test_and_the_exports_can_carry_them(tmp_path):
    subs = tmp_path / "subs"
    for student, value in {"ann": zero3_7p5b_64(None), "bob": 0.0}.items():
        (subs / student).mkdir(parents=True)
        nbformat.write(_lab01(value), subs / student / "01_memory.ipynb")
    (subs / "cat").mkdir()
    (subs / "cat" / "01_memory.ipynb").write_text("{", encoding="utf-8")
    out = tmp_path / "out"
    run_batch(subs, out, GradeOptions(notebook="01_memory", export_questions=True))
    rows = {r["student"]: r for r in _csv(out / "grades.csv")}
    header = list(rows["ann"])
    checks = [f"01_memory: {c.name}" for c in checks_for("01_memory")]
    assert header[:6] == list(gradebook.GRADES_COLUMNS) and header[6:6 + len(checks)] == checks
    tests = header[6 + len(checks):]
    assert tests and all(t.startswith(("01_memory: model_state_bytes: ", "01_memory: measure_state_bytes: "))
                         for t in tests)
    for row in rows.values():  # the questions add up to the total, for every status
        assert sum(float(row[h]) for h in header[6:]) == float(row["score"])
    zero3 = next(h for h in checks if "1.1 ZeRO-3" in h)
    assert rows["ann"][zero3] == "2" and rows["bob"][zero3] == "0" and rows["cat"]["status"] == "invalid"
    canvas = _csv(out / "canvas.csv")
    assert canvas[0]["Student"] == "Points Possible" and canvas[0][zero3] == "2"
    assert {r["Student"]: r[zero3] for r in canvas[1:]} == {"ann": "2", "bob": "0", "cat": "0"}
    gradescope = _csv(out / "gradescope" / "01_memory.csv")
    assert list(gradescope[0])[:4] == ["Name", "SID", "Email", "Score"] and gradescope[0][zero3] == "2"


def test_question_columns_come_from_the_plan_never_from_a_row():
    plan = [questions.Question("nb", "a", 2.0), questions.Question("nb", "a", 1.0, 2),
            questions.Question("other", "z", 5.0)]
    forged = Grade("mallory", "nb", "graded", 3, 3, "", (
        CheckResult("a", 2, 2, True, True, ""), CheckResult("a", 1, 1000, True, True, ""),
        CheckResult("made up", 1000, 1000, True, True, "")))
    assert [q.header for q in plan] == ["nb: a", "nb: a (2)", "other: z"]
    assert questions.earned(forged, plan) == ["2", "1", ""]  # clamped to the plan's points; no made-up column


def test_late_policy_takes_the_time_from_gradescope_a_received_list_or_the_file_and_honours_extensions(tmp_path,
                                                                                                       capsys):
    import json
    import os
    from datetime import datetime, timezone

    import pytest

    from labkit.cli import main

    subs = tmp_path / "subs"
    right = zero3_7p5b_64(None)
    for student in ("ann", "bob", "cy", "dan"):
        (subs / student).mkdir(parents=True)
        nbformat.write(_lab01(right), subs / student / "01_memory.ipynb")
    meta = {"ann": "2026-12-01T16:59:59.123456-07:00", "bob": "2026-12-03T10:00:00-05:00"}  # on time; 2 days late
    for student, when in meta.items():
        (subs / student / "submission_metadata.json").write_text(json.dumps({"id": 1, "created_at": when}))
    (subs / "received.csv").write_text("student,submitted_at\ncy,2026-12-02T01:00:00Z\n")  # an hour late: extension
    late = datetime(2026, 12, 4, 12, 0, tzinfo=timezone.utc).timestamp()  # dan: only the file's time, 3 days late
    os.utime(subs / "dan" / "01_memory.ipynb", (late, late))
    roster = tmp_path / "roster.csv"
    roster.write_text("id,name,email,extension\nann,,,\nbob,,,\ncy,,,0.5\ndan,,,\n")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as done:
        main(["grade", str(subs), "--out", str(out), "--notebook", "01_memory", "--roster", str(roster),
              "--deadline", "2026-12-02T00:00", "--late-penalty", "10", "--late-cap", "25"])
    assert done.value.code == 0, capsys.readouterr()
    rows = {r["student"]: r for r in _csv(out / "grades.csv")}
    assert list(rows["ann"])[6:9] == ["submitted_at", "days_late", "late_penalty"]
    got = {s: (r["submitted_at"], r["days_late"], r["late_penalty"], r["score"]) for s, r in rows.items()}
    assert got == {"ann": ("2026-12-01T23:59:59Z", "0", "0", "3"), "bob": ("2026-12-03T15:00:00Z", "2", "0.6", "2.4"),
                   "cy": ("2026-12-02T01:00:00Z", "0", "0", "3"), "dan": ("2026-12-04T12:00:00Z", "3", "0.75", "2.25")}
    assert "late: submitted 2026-12-03T15:00:00Z (submission_metadata.json), due 2026-12-02T00:00:00Z: 2 day(s) " \
           "late, -20% = -0.6 points" in rows["bob"]["detail"]
    assert "(file time)" in rows["dan"]["detail"] and "-25%" in rows["dan"]["detail"]  # the cap
    page = (out / "feedback" / "bob.html").read_text()
    assert "Submitted 2026-12-03T15:00:00Z: 2 day(s) late: 0.6 points taken off" in page and "Total: 2.4 / 25" in page
    assert "Submitted 2026-12-02T01:00:00Z: on time" in (out / "feedback" / "cy.html").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["grade", str(subs), "--out", str(tmp_path / "o2"), "--deadline", "next friday"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "--deadline 'next friday' is not a time" in err and err.count("\n") == 1
