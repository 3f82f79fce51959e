"""Grading a corpus of submissions end to end: a real papermill run, broken and forged copies of it.

One module-scoped papermill run of the demo notebook (tests/data/grading/corpus.py) feeds every test.
"""
from __future__ import annotations

import csv
import importlib.util
import os
import tempfile
from pathlib import Path

import nbformat
import psutil
import pytest
from click.testing import CliRunner

from labkit.cli import cli, main
from labkit.course.grading import registry
from labkit.course.grading.batch import GradeOptions, run_batch
from labkit.course.grading.isolation import detect
from labkit.course.grading.sandbox import Limits

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("grading_corpus", Path(__file__).parent / "data/grading/corpus.py")
corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """(source notebook, executed notebook) of the demo, with its checks registered."""
    registry.register(corpus.DEMO, corpus.demo_checks())
    root = tmp_path_factory.mktemp("demo")
    src = root / "src.ipynb"
    nbformat.write(corpus.demo_notebook(), str(src))
    out = corpus.execute(src, root / "executed.ipynb")
    yield nbformat.read(str(src), 4), nbformat.read(str(out), 4)
    registry.unregister(corpus.DEMO)


def _rows(out: Path) -> dict[str, dict[str, str]]:
    with (out / "grades.csv").open(newline="") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames[:6] == ["student", "notebook", "score", "max_score", "status", "detail"]  # then questions
        rows = list(reader)
    by_student = {r["student"]: r for r in rows}
    assert len(by_student) == len(rows)  # exactly one row per submission
    return by_student


def test_execute_batch_gives_every_submission_its_status_and_reason(executed, tmp_path):
    src, done = executed
    subs = tmp_path / "subs"
    corpus.write(subs, "good", done)
    corpus.write(subs, "malformed", corpus.MALFORMED)
    corpus.write(subs, "loop", corpus.demo_notebook(extra=corpus.LOOP))
    corpus.write(subs, "dies", corpus.demo_notebook(extra=corpus.DIES))
    corpus.write(subs, "bomb", corpus.demo_notebook(extra=corpus.BOMB))
    corpus.write(subs, "bigout", corpus.demo_notebook(extra=corpus.BIG_PRINT))
    corpus.write(subs, "network", corpus.demo_notebook(extra=corpus.NETWORK))
    corpus.write(subs, "edited", corpus.hand_edited(done))
    corpus.write(subs, "deleted", corpus.deleted_cells(done))
    corpus.write(subs, "wrong", corpus.wrong_notebook(done))
    # 60 s a cell: the endless loop costs a minute of one worker, but an honest cell never reaches it on a
    # busy machine (20 s did: rows became `timeout` at load 25).
    limits = Limits(timeout_s=60, memory_bytes=int(1.5 * 2**30), output_bytes=10 * 2**20)
    opts = GradeOptions(execute=True, workers=2, limits=limits)
    result = run_batch(subs, tmp_path / "out", opts)

    rows = _rows(tmp_path / "out")
    assert len(rows) == 10 and len(result.rows) == 10
    status = {s: r["status"] for s, r in rows.items()}
    assert status == {"good": "graded", "malformed": "invalid", "loop": "timeout", "dies": "error",
                      "bomb": "error", "bigout": "error", "network": "error", "edited": "tampered",
                      "deleted": "graded", "wrong": "invalid"}
    assert float(rows["good"]["score"]) == corpus.TOTAL_POINTS == float(rows["good"]["max_score"])
    assert "not valid JSON" in rows["malformed"]["detail"]
    assert "still running in cell 4 after 60 s" in rows["loop"]["detail"]
    assert "kernel died in cell 4" in rows["dies"]["detail"]
    assert "MemoryError" in rows["bomb"]["detail"] and "memory cap 1.5 GiB" in rows["bomb"]["detail"]
    assert "output cap" in rows["bigout"]["detail"]
    assert "cell 4 raised" in rows["network"]["detail"]
    if detect().network_isolated:
        assert "no network" in rows["network"]["detail"]
    else:  # the fallback says so in every executed row
        assert "network NOT isolated" in rows["network"]["detail"]
    assert "was edited after it was recorded" in rows["edited"]["detail"]
    assert float(rows["deleted"]["score"]) == corpus.TOTAL_POINTS - 4  # the three FSDP checks fail
    assert "FSDP per-rank peak below DDP" in rows["deleted"]["detail"]
    assert "wrong notebook" in rows["wrong"]["detail"] and "91_other_lab" in rows["wrong"]["detail"]
    # Cells before the failing one ran: nothing after it did, so nothing after it earned points.
    assert float(rows["dies"]["score"]) == 0.0
    # The loop ignores SIGINT/SIGTERM: only the hard kill of the process tree stops its kernel.
    assert _sandboxed_processes() == []
    assert (tmp_path / "out" / "executed" / "good" / f"{corpus.DEMO}.ipynb").is_file()
    assert not (tmp_path / "out" / "executed" / "bigout" / f"{corpus.DEMO}.ipynb").exists()


def test_recorded_batch_detects_tampering_without_executing(executed, tmp_path):
    _, done = executed
    subs = tmp_path / "subs"
    # All derived from one run: only one of them may stay sealed-intact, or they would be flagged as copies.
    variants = {"edited": corpus.hand_edited(done), "code": corpus.code_edited(done),
                "moved": corpus.moved_output(done), "unsealed": corpus.unsealed(done),
                "impossible": corpus.impossible(done), "huge": corpus.huge(done),
                "deleted": corpus.deleted_cells(done), "wrong": corpus.wrong_notebook(done),
                "malformed": corpus.MALFORMED}
    for student, nb in variants.items():
        corpus.write(subs, student, nb)
    (subs / "absent").mkdir()  # a student who submitted nothing still gets a row
    run_batch(subs, tmp_path / "out", GradeOptions(notebook=corpus.DEMO, workers=2))
    rows = _rows(tmp_path / "out")
    status = {s: r["status"] for s, r in rows.items()}
    assert status == {"edited": "tampered", "code": "tampered", "moved": "tampered",
                      "unsealed": "tampered", "impossible": "tampered", "huge": "invalid",
                      "deleted": "graded", "wrong": "invalid", "malformed": "invalid", "absent": "invalid"}
    assert "code changed after it produced" in rows["code"]["detail"]
    assert "cell 4: answer 'secret_ratio'" in rows["moved"]["detail"]
    assert "has no labkit seal" in rows["unsealed"]["detail"]
    assert "physically impossible" in rows["impossible"]["detail"]
    assert "above the 50 MiB cap" in rows["huge"]["detail"]
    assert "no 90_grading_demo.ipynb" in rows["absent"]["detail"]
    assert all(float(rows[s]["score"]) == 0 for s in ("edited", "code", "moved", "unsealed", "impossible"))
    assert float(rows["deleted"]["score"]) == corpus.TOTAL_POINTS - 4


def test_feedback_names_checks_but_never_reveals_hidden_expectations(executed, tmp_path):
    _, done = executed
    subs = tmp_path / "subs"
    corpus.write(subs, "ann", done)
    wrong_secret = corpus.hand_edited(done)  # any status: the page must still not leak
    corpus.write(subs, "bob", wrong_secret)
    run_batch(subs, tmp_path / "out")
    page = (tmp_path / "out" / "feedback" / "ann.html").read_text()
    assert "secret ratio" in page and "(hidden)" in page and "7B parameter count" in page
    assert str(corpus.SECRET) not in page and "secret_ratio" not in page
    assert "tampered" in (tmp_path / "out" / "feedback" / "bob.html").read_text()
    with (tmp_path / "out" / "canvas.csv").open(newline="") as fh:
        canvas = list(csv.reader(fh))
    assert canvas[0][:5] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]
    assert canvas[0][5] == corpus.DEMO and canvas[1][5] == "11"
    assert [r[3] for r in canvas[2:]] == ["ann", "bob"] and canvas[2][5] == "11" and canvas[3][5] == "0"
    assert (tmp_path / "out" / "gradescope" / f"{corpus.DEMO}.csv").read_text().startswith("Name,SID,Email,Score")


def test_a_copy_is_flagged_for_review_with_both_names_and_nobody_loses_points(executed, tmp_path):
    _, done = executed
    subs = tmp_path / "subs"
    corpus.write(subs, "carol", done)  # the original
    corpus.write(subs, "dave", done)  # a verbatim copy
    corpus.write(subs, "erin", corpus.resealed(done))  # a re-sealed copy: no seal in common, every value the same
    corpus.write(subs, "fay", corpus.resealed(done, step_time_s=0.1234))  # another run of the same notebook
    result = run_batch(subs, tmp_path / "out")
    assert [(r.student, r.status, r.score) for r in result.rows] == [
        (s, "graded", corpus.TOTAL_POINTS) for s in ("carol", "dave", "erin", "fay")]
    assert [(p.student, p.other, p.same_seals) for p in result.pairs] == [
        ("carol", "dave", True), ("carol", "erin", False), ("dave", "erin", False)]
    rows = _rows(tmp_path / "out")
    assert "identical to dave's (the same seals" in rows["carol"]["detail"]
    assert "identical to carol's (under other seals: re-sealed)" in rows["erin"]["detail"]
    assert "review" not in rows["fay"]["detail"]
    with (tmp_path / "out" / "review.csv").open(newline="") as fh:
        review = list(csv.DictReader(fh))
    assert [(r["student"], r["other"], r["same_seals"]) for r in review] == [
        ("carol", "dave", "yes"), ("carol", "erin", "no"), ("dave", "erin", "no")]
    page = (tmp_path / "out" / "feedback" / "erin.html").read_text()  # a student never sees another's name
    assert "carol" not in page and "dave" not in page


def test_grade_cli_writes_the_gradebook_and_exits_0(executed, tmp_path, capsys):
    _, done = executed
    corpus.write(tmp_path / "subs", "erin", done)
    corpus.write(tmp_path / "subs", "frank", corpus.MALFORMED)
    res = CliRunner().invoke(cli, ["grade", str(tmp_path / "subs"), "--out", str(tmp_path / "out"),
                                   "--workers", "2"])
    assert res.exit_code == 0, res.output
    assert "graded  erin/90_grading_demo  11/11" in res.output
    assert "invalid  frank/90_grading_demo" in res.output
    assert len(_rows(tmp_path / "out")) == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["grade", str(tmp_path / "nope"), "--out", str(tmp_path / "o2")])
    assert exit_info.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_check_cli_exit_codes(executed, tmp_path):
    _, done = executed
    good = corpus.write(tmp_path, "me", done)
    res = CliRunner().invoke(cli, ["check", str(good)])
    assert res.exit_code == 0, res.output
    assert "6/6 visible checks pass (8/8 points)" in res.output and "1 hidden check(s)" in res.output
    assert "secret" not in res.output

    partial = corpus.write(tmp_path, "partial", corpus.deleted_cells(done))
    res = CliRunner().invoke(cli, ["check", str(partial)])
    assert res.exit_code == 1
    assert "FAIL  FSDP per-rank peak below DDP" in res.output and "no run 'fsdp' recorded" in res.output

    edited = corpus.write(tmp_path, "edited", corpus.code_edited(done))
    res = CliRunner().invoke(cli, ["check", str(edited)])
    assert res.exit_code == 1 and "FIX   cell 4" in res.output and "re-run the cell" in res.output

    res = CliRunner().invoke(cli, ["check", str(tmp_path / "missing.ipynb")])
    assert res.exit_code == 2 and "no notebook at" in res.output


def _sandboxed_processes() -> list[int]:
    """Pids of processes still running in a sandbox scratch directory (kernels run there)."""
    scratch = os.path.join(tempfile.gettempdir(), "labkit-grade-")
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.cwd().startswith(scratch) and not _another_tests(proc):
                found.append(proc.pid)
        except (psutil.Error, OSError):
            pass
    return found


def _another_tests(proc) -> bool:
    """True when `proc` descends from another pytest process (the other xdist worker, or a second test run
    on this machine, grading at the same time): its sandbox is not ours. One of ours, or an orphan
    (re-parented to init: a leak of ours or of anyone's), counts."""
    me = os.getpid()
    for parent in proc.parents():
        if parent.pid == me:
            return False
        try:
            argv = parent.cmdline()[:4]  # `python -m pytest ...` / `pytest ...` (not an argument naming a pytest tmp path)
            if any(os.path.basename(a) in ("pytest", "py.test") for a in argv[:2]) or \
                    any(a == "-m" and b == "pytest" for a, b in zip(argv, argv[1:])):
                return True
        except (psutil.Error, OSError):
            continue
    return False
