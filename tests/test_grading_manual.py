"""Free-text answers a TA marks (issue #40 item 5): `manual` checks, `labkit grade review`, marks merged back.

A made-up notebook `t_manual` (registered for the test) with one automatic check and one manual question;
submissions hold hand-sealed answers (tests/test_grading_units.py's helpers), graded on recorded results.
The widget is driven here through its Python objects (the browser test, tests/test_grading_review_browser.py,
drives the same notebook in JupyterLab).
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import nbformat
import pytest

from labkit.cli import main
from labkit.course.grading import checks as K
from labkit.course.grading import manual, registry
from labkit.course.grading.batch import GradeOptions, run_batch
from test_grading_units import _answer, _nb

NB = "t_manual"
QUESTION = "7.4 why a pipeline"


@pytest.fixture
def graded(tmp_path):
    registry.register(NB, [K.answer_equals("layout", 1, "pp", 8), K.manual(QUESTION, 3, "why")])
    subs = tmp_path / "subs"
    texts = {"ann": "pp=8 because 175B does not fit in one node's memory",
             "bob": "<script>alert(1)</script> because", "cy": ""}
    for student, text in texts.items():
        write(subs, student, text)
    yield subs, tmp_path / "out"
    registry.unregister(NB)


def write(subs: Path, student: str, text: str) -> None:
    (subs / student).mkdir(parents=True, exist_ok=True)
    nbformat.write(_nb(_answer("pp", 8), _answer("why", text), identity=NB), subs / student / f"{NB}.ipynb")


def _cli(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as done:
        main(argv)
    return done.value.code or 0


def _grades(out: Path) -> dict[str, dict]:
    with (out / "grades.csv").open(newline="", encoding="utf-8") as fh:
        return {r["student"]: r for r in csv.DictReader(fh)}


def test_a_ta_marks_free_text_answers_and_the_marks_reach_the_gradebook_and_feedback(graded, capsys):
    subs, out = graded
    run_batch(subs, out, GradeOptions())
    rows = _grades(out)
    assert {s: (r["score"], r[f"{NB}: {QUESTION}"]) for s, r in rows.items()} == {
        "ann": ("1", "0"), "bob": ("1", "0"), "cy": ("1", "0")}
    assert "awaiting a TA&#x27;s mark" in (out / "feedback" / "ann.html").read_text()
    answers = json.loads((out / "manual.json").read_text())["answers"]
    assert [(a["student"], a["points"]) for a in answers] == [("ann", 3.0), ("bob", 3.0), ("cy", 3.0)]

    assert _cli(["grade", "review", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out and (out / "review.ipynb").is_file()
    widget = manual.review_widget(out)  # what the notebook's cell returns
    html = "".join(getattr(c, "value", "") for box in widget.children[1:-1] for c in box.children[:2])
    assert "&lt;script&gt;" in html and "<script>" not in html  # the student's text is shown, never run
    boxes = {box.children[0].value.split("</b>")[0][3:]: box.children for box in widget.children[1:-1]}
    boxes["ann"][2].value = 2.5  # points: saved at once
    boxes["ann"][3].value = "Right reason; name the memory per GPU."
    boxes["bob"][2].value = 99  # the box stops at the question's points
    saved = {m["student"]: m for m in json.loads((out / "marks.json").read_text())["marks"]}
    assert saved["ann"]["points"] == 2.5 and saved["bob"]["points"] == 3.0 and "cy" not in saved

    write(subs, "bob", "a new answer after marking")  # bob resubmits: his mark is for another answer
    run_batch(subs, out, GradeOptions())
    rows = _grades(out)
    assert rows["ann"]["score"] == "3.5" and rows["ann"][f"{NB}: {QUESTION}"] == "2.5"
    assert rows["bob"]["score"] == "1" and "the answer changed after it was marked" in rows["bob"]["detail"]
    page = (out / "feedback" / "ann.html").read_text()
    assert "Right reason; name the memory per GPU." in page and "Total: 3.5 / 4" in page
    assert "changed after it was marked" in (out / "feedback" / "bob.html").read_text()
    assert _cli(["grade", "review", str(out)]) == 0 and "kept the existing" in capsys.readouterr().out


def test_review_without_manual_answers_or_an_out_folder_is_one_line(tmp_path, capsys):
    assert _cli(["grade", "review", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no manual.json in" in err and err.count("\n") == 1
    assert _cli(["grade", str(tmp_path)]) == 2
    assert "--out OUT_DIR is missing" in capsys.readouterr().err
