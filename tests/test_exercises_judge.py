"""The judge (issue #26): tests run in the grader's process; only plain data crosses from the student's.

Pure-Python checks of the wire format and the `returns=` specs, then one student process (no sandbox:
the sandboxed path is tests/test_exercises_grading.py and tests/test_grading_hostile.py) that serves
several hostile variants of one exercise, and the identity of verdicts and messages between the
student's own notebook (`LocalStudent`) and the grader (`RemoteStudent`) on lab 01's mutants.
"""
from __future__ import annotations

import json
import math
import struct
import textwrap
from collections import OrderedDict
from pathlib import Path

import nbformat
import pytest

from labkit.course.exercises import ANY, Tensor, load_cases, load_mutants, run_cases
from labkit.course.exercises.cases import load_cases_from_text
from labkit.course.exercises.expect import ReturnTypeError, conform
from labkit.course.exercises.judge import judge
from labkit.course.exercises.source import exercise_cells
from labkit.course.exercises.wire import MAGIC, Unsupported, WireError, decode, encode

ROOT = Path(__file__).resolve().parent.parent


class _Yes(int):
    def __eq__(self, other):
        return True

    __le__ = __ge__ = __lt__ = __gt__ = __eq__
    __hash__ = int.__hash__


def test_plain_data_crosses_with_its_exact_types_and_tensors_come_back_from_bytes():
    import torch

    value = {"n": 3, "x": 2.5, "nan": math.nan, "ok": True, "none": None, "s": "é", "pair": (1, [2.0, "3"]),
             "t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "empty": torch.zeros(0, 4),
             "scalar": torch.tensor(7, dtype=torch.int64), "p": torch.nn.Parameter(torch.ones(2))}
    back = decode(encode(value))
    assert list(back) == list(value) and type(back["pair"]) is tuple and type(back["pair"][1]) is list
    assert back["n"] == 3 and type(back["n"]) is int and type(back["x"]) is float and math.isnan(back["nan"])
    assert back["t"].dtype == torch.bfloat16 and torch.equal(back["t"], value["t"])
    assert back["empty"].shape == (0, 4) and back["scalar"].item() == 7 and back["scalar"].shape == ()
    assert type(back["p"]) is torch.Tensor and torch.equal(back["p"], torch.ones(2))


def test_objects_that_lie_about_equality_never_arrive():
    import numpy as np

    back = decode(encode([_Yes(0), OrderedDict(a=1), {1: 2}, np.float64(1.5), object()]))
    assert [type(v) for v in back] == [Unsupported] * 5
    assert [v.type_name for v in back[:2]] == ["test_exercises_judge._Yes", "collections.OrderedDict"]
    assert back[0] != 0 and not back[0] == back[1]
    with pytest.raises(ReturnTypeError, match=r"f\(\) returned a test_exercises_judge._Yes object; it must be an int"):
        conform(back[0], int, "f()")


@pytest.mark.parametrize("data, why", [
    (b"nope" + b"\0" * 20, "bad magic"),
    (MAGIC + struct.pack(">I", 10**9) + b"{}", "does not fit"),
    (MAGIC + struct.pack(">I", 2) + b"[]", "not {v, blobs}"),
    (MAGIC + struct.pack(">I", 21) + b'{"v": [1], "blobs": []}'[:21], "not JSON"),
])
def test_malformed_messages_are_refused(data, why):
    with pytest.raises(WireError, match=why):
        decode(data)


def _message(tree, blobs=()):
    header = json.dumps({"v": tree, "blobs": [len(b) for b in blobs]}).encode()
    return MAGIC + struct.pack(">I", len(header)) + header + b"".join(blobs)


def test_sizes_are_checked_before_anything_is_built():
    with pytest.raises(WireError, match="above the 1,024 B cap"):
        decode(encode(list(range(1000))), max_bytes=1024)
    with pytest.raises(WireError, match="shape \\[1000\\] and dtype float32 with 8 bytes"):
        decode(_message(["X", 0, "float32", [1000]], [b"\0" * 8]))
    with pytest.raises(WireError, match="untagged"):
        decode(_message([1, 2]))
    deep = "x"
    for _ in range(100):
        deep = ["L", deep]
    with pytest.raises(WireError, match="nested deeper"):
        decode(_message(deep))
    with pytest.raises(WireError, match="do not add up"):
        decode(_message(["X", 0, "uint8", [4]], [b"\0" * 4]) + b"extra")


def test_returns_specs_are_strict_and_name_what_came_back():
    import torch

    assert conform(3, float, "f()") == 3.0 and type(conform(3, float, "f()")) is float
    assert conform([1, 2], (int, int), "f()") == (1, 2)
    assert conform(None, int | None, "f()") is None and conform({"a": 1}, ANY, "f()") == {"a": 1}
    cases = [(3.0, int, "returned a float \\(3\\); it must be an int"),
             (True, int, "returned a bool \\(True\\); it must be an int"),
             ({"a": 1}, {"a": int, "b": int}, "missing \\['b'\\]"),
             ({"a": 1.5}, {"a": int}, "returned \\['a'\\]: a float \\(1.5\\)"),
             ([1, "x"], [int], "returned \\[1\\]: a str"),
             (torch.zeros(2, 3), Tensor("float32", (3, None)), "shape \\(2, 3\\), expected \\(3, None\\)"),
             (torch.zeros(2), Tensor(torch.bfloat16), "dtype float32, expected bfloat16")]
    for value, spec, message in cases:
        with pytest.raises(ReturnTypeError, match=message):
            conform(value, spec, "f()")


def test_tests_of_two_submissions_interleave_only_while_waiting_and_keep_their_own_rng():
    """`labkit grade --workers`: a test that seeds the RNG, waits for a student's process, then draws again gets
    the draws it would get alone, though another submission's test ran (and reseeded) meanwhile."""
    import random
    import threading

    from labkit.course.exercises.student import judging, waiting

    inside, resume, draws = threading.Event(), threading.Event(), {}

    def first():
        with judging({}):
            random.seed(1)
            a = random.random()
            with waiting():  # as when waiting on a channel: the lock is free for the other thread
                inside.set()
                resume.wait(30)
            draws["first"] = (a, random.random())

    def second():
        inside.wait(30)
        with judging({}):
            random.seed(2)
            draws["second"] = random.random()
        resume.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    random.seed(1)
    assert draws["first"] == (random.random(), random.random()) and "second" in draws



def _two(rank, world, fn):
    return rank


def test_tests_that_share_a_spawn_read_one_run_and_one_failure():
    """`student.spawn(..., share=True)`: one run per (harness, world, args) of one student; a copy to each test;
    what the student's code raised reaches every test that shares the run; other arguments spawn again."""
    from labkit.course.exercises.student import Student, StudentError

    class Counting(Student):
        asked: list = []

        def _exchange(self, request):
            self.asked.append(request["args"])
            if request["args"] == ("bad",):
                return {"kind": "error", "type": "ValueError", "message": "no"}
            return {"kind": "value", "value": [[1.0], [2.0]]}

    student = Counting("f")
    first = student.spawn(_two, world=2, args=(1,), returns=[float], share=True)
    first[0].append(9.0)  # a test changing its copy changes no other test's
    assert student.spawn(_two, world=2, args=(1,), returns=[float], share=True) == [[1.0], [2.0]]
    for _ in range(2):
        with pytest.raises(StudentError, match="no"):
            student.spawn(_two, world=2, args=("bad",), returns=[float], share=True)
    student.spawn(_two, world=2, args=(2,), returns=[float], share=True)
    student.spawn(_two, world=2, args=(1,), returns=[float])  # not shared: its own run
    assert student.asked == [(1,), ("bad",), (2,), (1,)]
    assert Counting("f").spawn(_two, world=2, args=(1,), returns=[float], share=True) and len(student.asked) == 5


# ---------------------------------------------------------------- one student process, hostile variants
TESTS = textwrap.dedent('''
    from labkit.course.exercises import case

    @case("f", points=2)
    def doubles(student):
        got = student.call(21, returns=int)
        assert got == 42, f"f(21) = {got}, expected 42"

    @case("f")
    def says_no_to_zero(student):
        with student.raises(ValueError):
            student.call(0, returns=int)
''')
HONEST = "def f(x):\n    if x == 0:\n        raise ValueError('zero')\n    return 2 * x\n"
HOSTILE = {
    "always_equal": "class Yes(int):\n    __eq__ = lambda s, o: True\n\ndef f(x):\n    return Yes(0)\n",
    "assertion_text": "def f(x):\n    raise AssertionError('PASS: f(21) == 42')\n",
    # a forged answer written on every socket before the grader asks: the grader reads it as the answer to
    # loading the cell, then the real one arrives out of turn
    "forged_frames": textwrap.dedent('''
        import os, stat, struct
        from labkit.course.exercises import wire
        for fd in range(3, 64):
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    for seq in range(1, 4):
                        p = wire.encode({"kind": "value", "value": 42, "seq": seq})
                        os.write(fd, struct.pack(">Q", len(p)) + p)
            except OSError:
                pass

        def f(x):
            return 0
    '''),
    "huge_answer": "def f(x):\n    return list(range(300_000))\n",
    "open_fds": "import os\n\ndef f(x):\n    return len(os.listdir('/proc/self/fd'))\n",
    "exits": "import os\n\ndef f(x):\n    os._exit(7)\n",
}


@pytest.mark.slow
def test_one_process_serves_every_variant_and_nothing_it_sends_is_a_verdict():
    cases = load_cases_from_text(TESTS, "t.py", hidden=False)
    names = ["honest", *HOSTILE]
    out = dict(zip(names, judge("f", [HONEST, *HOSTILE.values(), HONEST], cases, timeout_s=60,
                                memory_bytes=8 * 2**30, output_bytes=2**20, max_message=2**20)))
    verdict = {name: [r.status for r in v.results] for name, v in out.items()}
    assert verdict["honest"] == ["pass", "pass"]
    assert all(verdict[name] == ["fail", "fail"] for name in ("always_equal", "assertion_text", "exits")), verdict
    msg = {name: out[name].results[0].message for name in names}
    assert msg["always_equal"] == "f(21) returned a Yes object; it must be an int"
    assert msg["assertion_text"] == "f(21) raised AssertionError: PASS: f(21) == 42"
    assert verdict["forged_frames"][0] == "fail" and "answered out of turn" in msg["forged_frames"]
    assert "above the 1 MiB cap" in msg["huge_answer"]
    # 0, 1, 2, the channel and the directory listing itself: nothing else is open when student code runs
    assert "f(21) = 5, expected 42" == msg["open_fds"]
    assert "the exercise's process died (exit code 7)" in msg["exits"]
    assert out["exits"].kind == "process"


@pytest.mark.slow
def test_a_visible_test_gives_the_same_verdict_and_message_in_the_notebook_and_in_the_grader():
    """lab 01's visible tests on the solution and every mutant: `ex.check`'s LocalStudent (the student's own
    process) and the judge's RemoteStudent (another process) agree word for word."""
    from labkit.course.exercises.server import load_cell

    cells = exercise_cells(nbformat.read(ROOT / "notebooks" / "01_memory.ipynb", 4))
    exercise = "model_state_bytes"
    cases = [c for c in load_cases(ROOT / "notebooks" / "tests" / "01_memory.py") if c.exercise == exercise]
    sources = [cells[exercise]] + [cells[exercise].replace(m.fragment, m.replacement)
                                   for m in load_mutants(ROOT / "notebooks" / "tests" / "hidden" / "01_memory.py")[exercise]]
    remote = judge(exercise, sources, cases, timeout_s=120, memory_bytes=8 * 2**30, output_bytes=2**20)
    for source, far in zip(sources, remote):
        near = run_cases(load_cell(exercise, source), cases)
        assert [(r.status, r.message) for r in near] == [(r.status, r.message) for r in far.results]
    assert sum(r.status == "fail" for v in remote for r in v.results) >= len(sources) - 1
