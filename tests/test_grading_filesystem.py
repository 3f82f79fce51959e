"""A hostile submissions folder (issue #40 items 1-2): an LMS export, a shared drop folder, unpacked archives.

One recorded-results batch (no --execute: nothing runs, so the test costs a second) over lab-01 notebooks with
hand-sealed answers (tests/test_grading_shards.py), beside a FIFO and a /dev/zero link named like notebooks,
a folder named like a notebook, a symlinked notebook and a symlinked folder pointing at alice's work, notebook
and folder names that are spreadsheet formulas, and folders whose safe file names meet (`alice smith` and the
name its page once had, `Cat` and `cat`). The batch must finish, give every entry its row, and give every
student a page of their own.
"""
from __future__ import annotations

import csv
import hashlib
import os
import threading
from pathlib import Path

import nbformat
import pytest

from labkit.course.grading import gradebook
from labkit.course.grading.batch import GradeOptions, run_batch
from labkit.course.grading.evaluate import SubmissionProblem, read_submitted
from labkit.course.grading.nb_checks.lab01_memory import zero3_7p5b_64
from test_grading_shards import _lab01

NB = "01_memory.ipynb"
TWIN = "alice_smith-" + hashlib.sha1(b"alice smith").hexdigest()[:6]  # what `alice smith`'s page was called
FORMULAS = ('=HYPERLINK("evil.example","click")', "=1+1")


def _write(subs: Path, student: str, nb, name: str = NB) -> Path:
    (subs / student).mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, subs / student / name)
    return subs / student / name


def _hostile(root: Path) -> Path:
    subs = root / "subs"
    right = _lab01(zero3_7p5b_64(None))
    alice = _write(subs, "alice smith", right)
    _write(subs, TWIN, _lab01(0.0))
    _write(subs, "Cat", right)
    _write(subs, "cat", _lab01(0.0))
    (subs / "fifo").mkdir()
    os.mkfifo(subs / "fifo" / NB)
    (subs / "zero").mkdir()
    (subs / "zero" / NB).symlink_to("/dev/zero")
    (subs / "dir").mkdir()
    (subs / "dir" / NB).mkdir()
    (subs / "linker").mkdir()
    (subs / "linker" / NB).symlink_to(alice)
    (subs / "mirror").symlink_to(subs / "alice smith", target_is_directory=True)
    for formula in FORMULAS:
        _write(subs, "eve", right, f"{formula}.ipynb")
    _write(subs, "=cmd|' -C calc'!A0", right)
    os.mkfifo(subs / "stray-fifo")  # not a folder: not a student, and never opened
    return subs


def _batch(subs: Path, out: Path, **opts):
    done: dict = {}
    worker = threading.Thread(target=lambda: done.update(result=run_batch(subs, out, GradeOptions(**opts))),
                              daemon=True)
    worker.start()
    worker.join(timeout=300)  # a blocked open never returns: the condition is that the batch ends
    assert not worker.is_alive(), "the batch blocked on a file"
    return done["result"]


def _csv(path: Path) -> list[list[str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.reader(fh))


def test_a_hostile_folder_grades_to_completion_with_the_right_rows_and_pages(tmp_path):
    subs = _hostile(tmp_path)
    out = tmp_path / "out"
    result = _batch(subs, out)
    rows = {(r.student, r.notebook): r for r in result.rows}
    expected_invalid = {
        ("fifo", "01_memory"): "is a named pipe (FIFO), not a notebook file",
        ("zero", "01_memory"): "is a symbolic link, not a file",
        ("dir", "01_memory"): "is a folder, not a notebook file",
        ("linker", "01_memory"): "is a symbolic link, not a file",
        ("mirror", ""): "the folder mirror is a symbolic link to another folder",
    }
    for key, reason in expected_invalid.items():
        assert rows[key].status == "invalid" and reason in rows[key].detail and rows[key].score == 0, rows[key]
    assert rows[("alice smith", "01_memory")].score == rows[("Cat", "01_memory")].score > 0
    assert rows[(TWIN, "01_memory")].score == rows[("cat", "01_memory")].score == 1  # one check passes
    for formula in FORMULAS:  # a notebook that is no course notebook: a row, and nothing executable in any file
        assert rows[("eve", formula)].status == "invalid"
    assert len(rows) == len(result.rows) == 12
    files = {p.relative_to(out).as_posix(): p for p in out.rglob("*.csv")}
    for name, path in files.items():
        for line in _csv(path):
            assert not any(cell[:1] in ("=", "+", "-", "@") for cell in line), (name, line)
    header = _csv(out / "canvas.csv")[0]
    assert "'=1+1" in header and any(h.startswith("'=HYPERLINK") for h in header)
    # every student has a page of their own; the two name collisions are warned about, not silent
    pages = {p.name: p.read_text(encoding="utf-8") for p in (out / "feedback").iterdir()}
    assert len(pages) == len({r.student for r in result.rows}) == 11
    alice, twin = pages[gradebook.safe_name("alice smith") + ".html"], pages[gradebook.safe_name(TWIN) + ".html"]
    assert "Feedback for alice smith" in alice and "Total: 3 / 25" in alice
    assert f"Feedback for {TWIN}" in twin and "Total: 1 / 25" in twin
    assert "Feedback for Cat" in pages["Cat.html"] and "Feedback for cat" in pages["cat~2.html"]
    assert result.problems == ("feedback/: 'cat' and 'Cat' map to the same file name 'cat': 'cat' is written as "
                               "'cat~2'",)
    # received.csv lists what was read (regular files only), each hashed
    received = {line[0] for line in _csv(out / "received.csv")[1:]}
    assert {"fifo", "zero", "dir", "linker", "mirror"}.isdisjoint(received) and "alice smith" in received


def test_read_submitted_reads_a_regular_file_once_and_nothing_else(tmp_path):
    good = tmp_path / "good.ipynb"
    good.write_bytes(b"x" * 100)
    assert read_submitted(good, 100) == b"x" * 100
    with pytest.raises(SubmissionProblem, match="above the 0 MiB cap"):
        read_submitted(good, 99)
    link = tmp_path / "link.ipynb"
    link.symlink_to(good)
    with pytest.raises(SubmissionProblem, match="is a symbolic link"):
        read_submitted(link)
    assert read_submitted(link, follow=True) == b"x" * 100  # `labkit check` on the user's own path
    os.mkfifo(tmp_path / "pipe.ipynb")
    for path, kind in ((tmp_path / "pipe.ipynb", "named pipe"), (Path("/dev/zero"), "a device")):
        with pytest.raises(SubmissionProblem, match=kind) as info:
            read_submitted(path, follow=True)
        assert info.value.status == "invalid"
