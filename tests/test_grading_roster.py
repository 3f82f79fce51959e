"""`labkit grade --roster` (issue #40 item 3): every rostered student has a row, folders on no line are listed.

Recorded-results batches of hand-sealed lab-01 notebooks (tests/test_grading_shards.py): nothing executes.
"""
from __future__ import annotations

import csv
from pathlib import Path

import nbformat
import pytest

from labkit.cli import main
from labkit.course.grading import shards
from labkit.course.grading.batch import GradeOptions, listing, maxima, questions_for, roster_of, run_batch
from labkit.course.grading.nb_checks.lab01_memory import zero3_7p5b_64
from test_grading_shards import _lab01

ROSTER = ("Student ID,Name,Email,Extension\nann,Ann Lee,ann@uni.edu,\n2002,Bob Roy,bob@uni.edu,2\n"
          "3003,Cy Dee,cy@uni.edu,0.5\n")


def _class(root: Path) -> tuple[Path, Path]:
    subs = root / "subs"
    for folder, value in {"ann": zero3_7p5b_64(None), "BOB@uni.edu": 0.0, "zed": 0.0}.items():
        (subs / folder).mkdir(parents=True)
        nbformat.write(_lab01(value), subs / folder / "01_memory.ipynb")
    roster = root / "roster.csv"
    roster.write_text(ROSTER, encoding="utf-8")
    return subs, roster


def _csv(path: Path) -> list[dict]:
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _cli(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as done:
        main(argv)
    return done.value.code or 0


def test_every_rostered_student_gets_a_row_and_unrostered_folders_are_listed(tmp_path, capsys):
    subs, roster = _class(tmp_path)
    out = tmp_path / "out"
    assert _cli(["grade", str(subs), "--out", str(out), "--roster", str(roster)]) == 0
    printed = capsys.readouterr().out
    assert "roster: 3 students" in printed
    assert "warning: the folder 'zed' is on no line of the roster (graded; unrostered.csv)" in printed
    rows = {r["student"]: r for r in _csv(out / "grades.csv")}
    assert set(rows) == {"ann", "BOB@uni.edu", "zed", "3003"}
    assert rows["3003"]["status"] == "missing" and rows["3003"]["score"] == "0"
    assert rows["3003"]["detail"] == "not submitted" and rows["3003"]["max_score"] == rows["ann"]["max_score"]
    assert rows["ann"]["status"] == rows["BOB@uni.edu"]["status"] == rows["zed"]["status"] == "graded"
    assert _csv(out / "unrostered.csv") == [{"folder": "zed", "notebooks": "01_memory"}]
    summary = _csv(out / "summary.csv")[0]
    assert summary["missing"] == "1" and summary["submissions"] == "4"
    canvas = {r["SIS Login ID"]: r for r in _csv(out / "canvas.csv")}
    assert canvas["BOB@uni.edu"]["Student"] == "Bob Roy" and canvas["BOB@uni.edu"]["SIS User ID"] == "2002"
    assert canvas["3003"]["Student"] == "Cy Dee" and canvas["3003"]["01_memory"] == "0"
    gradescope = {r["SID"]: r for r in _csv(out / "gradescope" / "01_memory.csv")}
    assert gradescope["2002"]["Name"] == "Bob Roy" and gradescope["2002"]["Email"] == "bob@uni.edu"
    assert gradescope["zed"]["Name"] == "zed" and gradescope["3003"]["Score"] == "0"
    assert "Feedback for 3003" in (out / "feedback" / "3003.html").read_text()


def test_a_class_with_a_roster_merges_from_shards_into_one_machines_gradebook(tmp_path):
    subs, roster = _class(tmp_path)
    opts = GradeOptions(roster=str(roster), export_questions=True)
    run_batch(subs, tmp_path / "single", opts)
    everything = listing(subs, opts)
    most = maxima(everything, opts)
    parts = []
    for i in range(2):
        part = tmp_path / f"shard-{i}"
        result = run_batch(subs, part, opts, select=lambda s, i=i: shards.select(s, i, 2))
        shards.write_shard(part, i, 2, everything, result.rows,
                           shards.plan_of(opts, most, roster_of(opts), questions_for(most, opts)))
        parts.append(part)
    shards.merge(parts, tmp_path / "merged")
    files = lambda d: {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}  # noqa: E731
    assert files(tmp_path / "merged") == files(tmp_path / "single")


@pytest.mark.parametrize("text, says", [
    ("name,email\nAnn,ann@x\n", "no student id column in the header"),
    ("id,name\nann,Ann\nANN,Ann again\n", "line 3: student id 'ANN' is also on line 2"),
    ("id,extension\nann,two days\n", "line 2: extension 'two days'; give a number of days >= 0"),
    ("id,name\n,Nobody\n", "line 2: no student id"),
])
def test_a_malformed_roster_is_one_line_naming_the_fix(tmp_path, capsys, text, says):
    subs, roster = _class(tmp_path)
    roster.write_text(text, encoding="utf-8")
    assert _cli(["grade", str(subs), "--out", str(tmp_path / "out"), "--roster", str(roster)]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
