"""Lab 01 graded as a dishonest student would try it (issue #26), through the real `labkit assign` / `labkit grade`.

Each trick of the issue is a real submission whose exercise functions are WRONG (they return 0): replacing
the case runner in its own process, forging a report on the descriptors it finds and exiting, returning
objects whose __eq__ / __le__ / __ge__ always say True, reading the calling test's locals and helpers.
Against the old runner (tests beside the student's code) each scored full marks; now the tests run in the
grader's process and each scores 0, with and without --execute, while the honest solution scores full
marks in both. Submissions hold only the parameters cell and the exercise cells with their `ex.check`
cells, so an --execute run stays cheap. Stage 2 of #26 extends this corpus (sandbox binds, cgroups,
gradebook containment, copy detection).
"""
from __future__ import annotations

import csv
import re
import textwrap
from pathlib import Path

import nbformat
import pytest

from labkit.cli import main
from labkit.course.exercises.source import exercise_id

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = "01_memory"
EXERCISES = ("model_state_bytes", "measure_state_bytes")
WRONG = {"model_state_bytes": "def model_state_bytes(params, precision='mixed-bf16', optimizer='adamw', zero_stage=0, dp=1):\n"
                              "    return {result}\n",
         "measure_state_bytes": "def measure_state_bytes(model, optimizer, inputs):\n    return {result}\n"}
ZEROS = {"model_state_bytes": "0", "measure_state_bytes": '{"weights": 0, "grads": 0, "optimizer": 0}'}

ATTACKS = {
    # the old runner ran the cases in this process: make every case pass, whichever module runs them
    "replace_runner": (textwrap.dedent('''
        import labkit.course.exercises.cases as _cases
        import labkit.course.exercises.runner as _runner
        _all_pass = lambda fn, cases, **kw: [_cases.CaseResult(c, "pass") for c in cases]
        _cases.run_cases = _runner.run_cases = _all_pass
        _cases.run_case = lambda case, fn: _cases.CaseResult(case, "pass")
        try:
            import labkit.course.exercises.verdicts as _verdicts
            _verdicts.run_cases, _verdicts.run_case = _all_pass, _cases.run_case
        except ImportError:
            pass
    '''), ZEROS),
    # an all-pass report worth 1000 points a test, on the descriptor named in sys.argv (else on every one)
    "forged_report": (textwrap.dedent('''
        import gc, json, os, sys
        _names = sorted({o.name for o in gc.get_objects() if type(o).__name__ == "Case"}) or ["x"]
        _forged = json.dumps({"variants": [{"results": [{"name": n, "hidden": False, "points": 1000,
                                                          "status": "pass", "message": "ok"} for n in _names]}]})
        _fds = [int(sys.argv[sys.argv.index("--report-fd") + 1])] if "--report-fd" in sys.argv else range(3, 64)
        for _fd in _fds:
            try:
                os.write(_fd, _forged.encode())
            except OSError:
                pass
        os._exit(0)
    '''), ZEROS),
    "always_equal": (textwrap.dedent('''
        class _Yes(int):
            def __eq__(self, other):
                return True
            __le__ = __ge__ = __lt__ = __gt__ = __eq__
            __ne__ = lambda self, other: False
            __hash__ = int.__hash__

        class _YesDict(dict):
            __eq__ = lambda self, other: True
            __getitem__ = lambda self, key: _Yes(0)
    '''), {"model_state_bytes": "_Yes(0)",
           "measure_state_bytes": '_YesDict(weights=_Yes(0), grads=_Yes(0), optimizer=_Yes(0))'}),
    # the expected answer from the calling test: its locals (n, total, want) or its helpers (_estimate)
    "read_test_locals": (textwrap.dedent('''
        import gc, sys

        def _test_helper(name):
            for obj in gc.get_objects():
                if getattr(obj, "__name__", "") == name and "labkit_exercise_tests" in str(getattr(obj, "__module__", "")):
                    return obj

        def _caller(*names):
            frame = sys._getframe(2)
            while frame is not None:
                for name in names:
                    if name in frame.f_locals:
                        return frame.f_locals[name]
                frame = frame.f_back

        def _answer(*args):
            helper = _test_helper("_estimate")
            if helper is not None:
                return helper(*args)
            want = _caller("want", "expected")
            return want if want is not None else 0

        def _states():
            n = _caller("n", "total")
            k = _caller("trainable")
            k = k if isinstance(k, int) else n
            return {"weights": 4 * n, "grads": 4 * k, "optimizer": 8 * k} if n else {"weights": 0, "grads": 0, "optimizer": 0}
    '''), {"model_state_bytes": "_answer(params, precision, optimizer, zero_stage, dp)",
           "measure_state_bytes": "_states()"}),
}


def _submission(cells: dict[str, str]):
    """The source notebook's parameters cell and exercise cells (replaced by `cells`) with their check cells."""
    src = nbformat.read(ROOT / "notebooks" / f"{NOTEBOOK}.ipynb", 4)
    keep = []
    for i, cell in enumerate(src.cells):
        ex = exercise_id(cell)
        if "parameters" in cell.metadata.get("tags", []):
            keep.append(cell)
        elif ex in cells:
            cell.source = cells[ex]
            keep += [cell, src.cells[i + 1]]  # the exercise cell and its `ex.check` cell
    src.cells = keep
    return src


def _attack(name: str) -> dict[str, str]:
    prelude, results = ATTACKS[name]
    return {ex: f"# EXERCISE {ex}: attacked\n{prelude}\n" + WRONG[ex].format(result=results[ex]) for ex in EXERCISES}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    with pytest.raises(SystemExit) as done:
        main(["assign", "--out", str(root / "release"), "--source", str(ROOT / "notebooks")])
    assert done.value.code in (0, None)
    honest = {ex: src for ex, src in _source_cells().items() if ex in EXERCISES}
    for student, cells in [("honest", honest), *((name, _attack(name)) for name in ATTACKS)]:
        (root / "subs" / student).mkdir(parents=True)
        nbformat.write(_submission(cells), root / "subs" / student / f"{NOTEBOOK}.ipynb")
    return root


def _source_cells() -> dict[str, str]:
    from labkit.course.exercises.source import exercise_cells

    return exercise_cells(nbformat.read(ROOT / "notebooks" / f"{NOTEBOOK}.ipynb", 4))


def _grade(root: Path, out: str, *extra: str) -> dict[str, dict]:
    with pytest.raises(SystemExit) as done:
        main(["grade", str(root / "subs"), "--out", str(root / out), "--autograder", str(root / "release" / "autograder"),
              "--workers", "2", *extra])
    assert done.value.code in (0, None)
    with (root / out / "grades.csv").open() as fh:
        return {row["student"]: row for row in csv.DictReader(fh)}


def _code_scores(row: dict) -> dict[str, str]:
    return dict(re.findall(r"\b(model_state_bytes|measure_state_bytes) ([\d.]+/[\d.]+)", row["detail"].split("code: ", 1)[1]))


def _assert_attacks_score_nothing(root: Path, rows: dict[str, dict], out: str) -> None:
    assert set(rows) == {"honest", *ATTACKS}
    assert _code_scores(rows["honest"]) == {"model_state_bytes": "12/12", "measure_state_bytes": "6/6"}, rows["honest"]
    for name in ATTACKS:
        assert _code_scores(rows[name]) == {"model_state_bytes": "0/12", "measure_state_bytes": "0/6"}, rows[name]
        assert rows[name]["max_score"] == rows["honest"]["max_score"]
        page = (root / out / "feedback" / f"{name}.html").read_text()
        assert "7500000000" not in page and "1234567" not in page  # hidden tests' inputs and expected values


def test_each_trick_scores_zero_without_execute_and_the_honest_solution_full_marks(corpus, capsys):
    rows = _grade(corpus, "out")
    print(capsys.readouterr().out)  # the batch's own lines, for the record (`pytest -s`)
    _assert_attacks_score_nothing(corpus, rows, "out")


def test_each_trick_scores_zero_with_execute_too(corpus):
    rows = _grade(corpus, "out-exec", "--execute", "--timeout", "300")
    _assert_attacks_score_nothing(corpus, rows, "out-exec")
    assert rows["honest"]["status"] == "graded", rows["honest"]  # its ex.check cells leave the tests to the grader
