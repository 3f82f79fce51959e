"""A class graded in SLURM shards equals one machine's run (issue #28 part 3).

Lab 01 submissions with hand-sealed recorded answers and no exercise cells (their code tests are `missing`,
so no sandboxed process starts): right, wrong, tampered, not JSON, no notebook at all. One machine grades
them with run_batch; `labkit grade --emit slurm --shards 3` writes the array job, each task's command runs
with SLURM_ARRAY_TASK_ID set (bash, as sbatch would), `labkit grade merge` joins the parts, and every
gradebook file is compared byte for byte.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

from labkit.cli import main
from labkit.course.grading import shards
from labkit.course.grading.batch import GradeOptions, run_batch
from labkit.course.grading.evaluate import Grade
from labkit.course.grading.fingerprint import seal
from labkit.course.grading.nb_checks.lab01_memory import zero3_7p5b_64
from labkit.results import MIME

ROOT = Path(__file__).resolve().parent.parent
KEY = "01.zero3_7p5b_64gpus_gb"


def _lab01(value: float, *, edit_after: float | None = None):
    """A lab-01 notebook whose answer cell recorded `value` under a real seal (`edit_after`: then hand-edited)."""
    source = f'import labkit.results as R\nR.answer("{KEY}", {value!r})'
    text = f"answer {KEY} = {value!r}"
    payload = seal({"kind": "answer", "key": KEY, "value": value}, text, cell=(source, 1))
    if edit_after is not None:
        payload["value"] = edit_after
    cell = new_code_cell(source, execution_count=1,
                         outputs=[new_output("display_data", data={MIME: payload, "text/plain": text})])
    return new_notebook(cells=[cell], metadata={"labkit": {"notebook": "01_memory"}})


def _class(root: Path) -> Path:
    subs = root / "subs"
    right = zero3_7p5b_64(None)
    for student, nb in {"ann": _lab01(right), "bob": _lab01(0.0), "cat": _lab01(0.0, edit_after=right),
                        "fay": _lab01(right), "gus": _lab01(right * 1.01)}.items():
        (subs / student).mkdir(parents=True)
        nbformat.write(nb, subs / student / "01_memory.ipynb")
    (subs / "dan").mkdir()
    (subs / "dan" / "01_memory.ipynb").write_text('{"cells": [', encoding="utf-8")
    (subs / "eve").mkdir()  # no notebook at all
    return subs


def _files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.relative_to(out).parts[0] not in ("parts", "slurm")}


def _cli(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as done:
        main(argv)
    return done.value.code or 0


@pytest.mark.slow  # three `labkit grade --shard` processes
def test_slurm_shards_merge_into_the_single_machine_gradebook(tmp_path, capsys):
    subs = _class(tmp_path)
    single = tmp_path / "single"
    run_batch(subs, single, GradeOptions(notebook="01_memory"))
    out = tmp_path / "class"
    assert _cli(["grade", str(subs), "--out", str(out), "--notebook", "01_memory", "--emit", "slurm",
                 "--shards", "3"]) == 0
    script = out / "slurm" / "grade.sbatch"
    text = script.read_text()
    assert "#SBATCH --array=0-2" in text and "--shard \"$SLURM_ARRAY_TASK_ID/3\"" in text
    assert not (out / "grades.csv").exists()  # --emit grades nothing here
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for task in range(3):  # what each array task runs
        done = subprocess.run(["bash", str(script)], env={**env, "SLURM_ARRAY_TASK_ID": str(task)},
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    parts = sorted((out / "parts").iterdir())
    assert [p.name for p in parts] == ["shard-0", "shard-1", "shard-2"]
    assert _cli(["grade", "merge", *map(str, parts), "--out", str(out)]) == 0
    merged, alone = _files(out), _files(single)
    assert set(merged) == set(alone) and "feedback/ann.html" in merged and "received.csv" in merged
    assert {name for name in merged if merged[name] != alone[name]} == set()
    grades = (out / "grades.csv").read_text()
    assert ",tampered," in grades and ",invalid," in grades and grades.count("\n") == 8  # header + 7 students


def _fake_part(folder: Path, index: int, count: int, subs, plan=None) -> Path:
    folder.mkdir(parents=True)
    rows = [Grade(s.student, s.notebook, "graded", 1.0, 2.0, "1/2 checks pass") for s in shards.select(subs, index, count)]
    shards.write_shard(folder, index, count, subs, rows, plan or {"maxima": {"01_memory": 2.0}})
    return folder


def test_merge_refuses_missing_repeated_foreign_and_mixed_shards_in_one_line(tmp_path, capsys):
    from labkit.course.grading.batch import find_submissions

    subs_dir = _class(tmp_path)
    subs = find_submissions(subs_dir, "01_memory")
    a, b = _fake_part(tmp_path / "p0", 0, 3, subs), _fake_part(tmp_path / "p1", 1, 3, subs)
    cases = {
        "shard(s) 2 of 3 missing; run them (sbatch --array=2": [a, b],
        "are both shard 0/3; pass each shard once": [a, b, _fake_part(tmp_path / "again", 0, 3, subs)],
        "is not a shard (no shard.json)": [a, tmp_path / "subs"],
        "is a shard of 3 but": [a, _fake_part(tmp_path / "four", 1, 4, subs)],
        "another plan": [a, _fake_part(tmp_path / "plan", 2, 3, subs, {"maxima": {"01_memory": 9.0}})],
        "no shards to merge": [],
    }
    for message, parts in cases.items():
        capsys.readouterr()
        assert _cli(["grade", "merge", *map(str, parts), "--out", str(tmp_path / "out")]) == 2, message
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    (tmp_path / "empty").mkdir()
    assert _cli(["grade", str(tmp_path / "empty"), "--out", str(tmp_path / "o"), "--emit", "slurm"]) == 2
    err = capsys.readouterr().err
    assert "no submissions in" in err and "<student>/<notebook>.ipynb" in err and err.count("\n") == 1
    assert _cli(["grade", str(subs_dir), "--out", str(tmp_path / "o"), "--shard", "3/3"]) == 2
    assert "give I/K with 0 <= I < K" in capsys.readouterr().err


def test_every_student_is_in_exactly_one_shard(tmp_path):
    from labkit.course.grading.batch import find_submissions

    subs = find_submissions(_class(tmp_path), "01_memory")
    groups = [shards.select(subs, i, 3) for i in range(3)]
    assert sorted(s.student for g in groups for s in g) == sorted(s.student for s in subs)
    assert all(groups)


def test_merge_refuses_a_shard_whose_rows_are_not_its_students_or_repeat_one(tmp_path, capsys):
    from labkit.course.grading.batch import find_submissions

    subs = find_submissions(_class(tmp_path), "01_memory")
    good = [_fake_part(tmp_path / f"p{i}", i, 3, subs) for i in (1, 2)]
    mine, other = shards.select(subs, 0, 3), shards.select(subs, 1, 3)
    row = lambda s: Grade(s.student, s.notebook, "graded", 2.0, 2.0, "2/2 checks pass")  # noqa: E731
    cases = {
        f"holds '{other[0].student}'/'01_memory', which is not one of its students": [*mine, other[0]],
        f"grades '{mine[0].student}'/'01_memory' more than once": [*mine, mine[0]],
        f"holds no row for '{mine[-1].student}'": mine[:-1],
    }
    for i, (message, listed) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}"
        bad.mkdir()
        shards.write_shard(bad, 0, 3, subs, [row(s) for s in listed], {"maxima": {"01_memory": 2.0}})
        capsys.readouterr()
        assert _cli(["grade", "merge", str(bad), *map(str, good), "--out", str(tmp_path / "out")]) == 2, message
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out" / "grades.csv").exists()
