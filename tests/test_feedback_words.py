"""Feedback that names the mistake (issue #39): a numeric answer off by a known factor says which, an
unanswered question is TODO (not FAIL), 7.4b has its own message, a multi-rank failure names the first
rank's own exception. No kernel, no rank: sealed payloads built as in tests/test_grading_questions.py."""
from __future__ import annotations

import pytest
from test_grading_questions import _answer, _check, _evidence

from labkit.cli.check import CheckReport, format_report
from labkit.course.grading.checks import answer_close, answer_equals
from labkit.course.grading.factors import factor_hint


@pytest.mark.parametrize("got, want, says", [
    (2.04e8, 2.72e8, "(N-1)/N = 3/4 of the right value (N = 4)"),
    (3.0, 2.0, "N/(N-1) = 3/2"),
    (8.0, 2.0, "4 times the right value: a factor 4: bytes per fp32 element"),
    (1.0, 2.0, "half the right value: a factor 2"),
    (2**30, 1e9, "GB and GiB mixed"),
    (3.0, 1.0, "N = 3 times the right value: divide by the number of ranks once"),
    (0.125, 1.0, "an eighth of the right value"),
])
def test_a_numeric_answer_off_by_a_known_factor_says_which(got, want, says):
    assert says in factor_hint(got, want)


def test_an_answer_off_by_no_known_factor_gets_no_guess():
    assert factor_hint(1.37, 1.0) == factor_hint(1.0, 0.0) == factor_hint(0.0, 1.0) == ""


def test_answer_close_names_the_factor_and_an_unanswered_question_is_todo():
    check = answer_close("x.1 all-reduce bytes", 1, "03.bytes", 2.72e8, rtol=0.01)
    off = check.run(_evidence("03_ddp", "smoke", [_answer("03.bytes", 2.04e8)]))
    assert not off.passed and not off.todo and "(N-1)/N = 3/4" in off.message and "2.72" not in off.message
    blank = check.run(_evidence("03_ddp", "smoke", [_answer("03.bytes", None)]))
    assert not blank.passed and blank.todo and "not written yet" in blank.message
    same = answer_equals("x.2 in flight", 1, "03.k", [8, 4]).run(_evidence("03_ddp", "smoke", [_answer("03.k", None)]))
    assert same.todo and "None is not the expected answer" not in same.message
    text = format_report(CheckReport("03_ddp", (off, blank, same), 0, ()))
    assert "  FAIL  x.1 all-reduce bytes" in text and "  TODO  x.1 all-reduce bytes" in text
    assert "  TODO  x.2 in flight" in text


def test_7_4b_has_its_own_message_when_the_layout_of_7_4a_is_not_usable():
    numbers = {"step_s": 1.0, "memory_gb": 10.0, "best_step_s": 1.0}
    ev = _evidence("07_model_parallel", "smoke", [_answer("07.layout_175b_64xa100", {"dp": 1}),
                                                  _answer("07.layout_175b_numbers", numbers)])
    a, b = _check("07_model_parallel", "7.4a").run(ev), _check("07_model_parallel", "7.4b").run(ev)
    assert not a.passed and not b.passed and a.message != b.message
    assert "finish 7.4a first" in b.message
    blank = _evidence("07_model_parallel", "smoke", [_answer("07.layout_175b_64xa100", None),
                                                     _answer("07.layout_175b_numbers", None)])
    assert all(_check("07_model_parallel", p).run(blank).todo for p in ("7.4a", "7.4b"))


def test_the_first_rank_that_failed_by_itself_is_named_not_a_peer_that_lost_it(tmp_path):
    """A ring that walks the wrong way on 3 ranks: gloo aborts rank 0 (a signal, no Python error, its log says
    "size doesn't match"), rank 2 then raises "Connection reset by peer" first, rank 1 is killed by the caller."""
    import cloudpickle

    from labkit.course.exercises.rank_errors import first_cause

    (tmp_path / "rank_0.log").write_text("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
                                         "  what():  Received data size doesn't match expected size.\n")
    reset = ("RuntimeError", "[pair.cc:545] Read error: Connection reset by peer.", "Traceback ...")
    (tmp_path / "error_2.pkl").write_bytes(cloudpickle.dumps(reset))
    assert first_cause(tmp_path, [-6, -9, 1]) == 0
    assert first_cause(tmp_path, [-9, -9, 1]) is None  # every failure reads as a lost peer: the caller decides
    (tmp_path / "error_1.pkl").write_bytes(cloudpickle.dumps(("ValueError", "chunk 3 of 3", "Traceback ...")))
    assert first_cause(tmp_path, [-9, 1, 1]) == 1  # a Python error of its own beats a peer's reset


def test_an_exercise_left_as_the_release_stub_is_todo_without_starting_its_process(tmp_path, monkeypatch):
    """issue #39 item 7: `labkit check` on a fresh notebook starts no student process for an untouched stub."""
    import nbformat

    import labkit.course.exercises.grading as grading
    from labkit.cli.check import check_notebook, format_report
    from labkit.course.exercises.source import exercise_cells, exercise_id, stub, untouched_stub

    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    for path in sorted((root / "notebooks").glob("0*.ipynb")):
        for ex, source in exercise_cells(nbformat.read(path, 4)).items():
            assert not untouched_stub(source, ex), (path.stem, ex)  # a solution is never taken for a stub
    hostile = ("import os\nos.system('x')\ndef f():\n    raise NotImplementedError\n",
               "def f(x=print('hi')):\n    raise NotImplementedError\n",
               "@functools.cache\ndef f():\n    raise NotImplementedError\n",
               "def f():\n    return 1\n    raise NotImplementedError\n")
    assert not any(untouched_stub(text, "f") for text in hostile)
    nb = nbformat.read(root / "notebooks" / "01_memory.ipynb", 4)
    for cell in nb.cells:
        if exercise_id(cell):
            cell.source = stub(cell.source, exercise_id(cell))
    nbformat.write(nb, tmp_path / "01_memory.ipynb")
    monkeypatch.setattr(grading, "run_variants", lambda *a, **k: pytest.fail("a process was started"))
    report = check_notebook(tmp_path / "01_memory.ipynb", "01_memory", tests=root / "notebooks" / "tests")
    assert [g.status for g in report.code] == ["not attempted", "not attempted"]
    assert "  TODO  model_state_bytes: not attempted" in format_report(report)


def test_every_released_stub_is_recognised_without_a_process_class_stubs_included():
    """issue #39 item 7: 06's `lora_linear` returns the student's class, whose `__init__` is the stub: still
    TODO without starting a process (it took 7 s); a class that was written, or a call that computes, is not."""
    from labkit.course.exercises.release import released_notebook
    from labkit.course.exercises.source import exercise_cells, untouched_stub

    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    stubs = {(path.stem, ex): untouched_stub(source, ex)
             for path in sorted((root / "notebooks").glob("0*.ipynb"))
             for ex, source in exercise_cells(released_notebook(path)).items()}
    assert len(stubs) >= 20 and all(stubs.values()), [k for k, v in stubs.items() if not v]
    stub = ("import torch\nfrom torch import nn\n\n\nclass L(nn.Module):\n    \"\"\"doc\"\"\"\n\n"
            "    def __init__(self, base, r):\n        super().__init__()\n        INIT\n\n"
            "def f(base, r=8):\n    \"\"\"doc\"\"\"\n    return CALL\n")
    todo = 'raise NotImplementedError("exercise f: write your code here")'
    assert untouched_stub(stub.replace("INIT", todo).replace("CALL", "L(base, r)"), "f")
    written = stub.replace("INIT", "self.base = base").replace("CALL", "L(base, r)")
    computing = stub.replace("INIT", todo).replace("CALL", "L(print('hi'), r)")
    other = stub.replace("INIT", todo).replace("CALL", "nn.Linear(base, r)")
    after = stub.replace("INIT", "self.r = r\n        " + todo).replace("CALL", "L(base, r)")
    assert not any(untouched_stub(text, "f") for text in (written, computing, other, after))
