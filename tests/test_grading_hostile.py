"""Lab 01 graded as a dishonest student would try it (issue #26), through the real `labkit assign` / `labkit grade`.

Every attack is a real submission in one of three `labkit grade SUBMISSIONS --out OUT --autograder
release/autograder` runs (one run over many submissions, not one per attack), with the release written
INSIDE the source tree (`build/`, git-ignored), as the docs once suggested:

- recorded (no --execute): the honest exercise cells, and wrong code (it returns 0) with each tampering
  trick -- replacing the case runner, forging a report on the descriptors it finds, objects whose __eq__ /
  __le__ / __ge__ always say True, reading the calling test's locals -- plus code that tries to leak the
  hidden tests (their arguments through its exceptions and output, their files from the release and the
  tree), messages no file can hold (lone surrogates, NUL, megabytes), an answer above the output cap;
- executed (--execute): the unmodified solution notebook (full marks), the four tricks together in one
  notebook (they run in its kernel too), a notebook that looks for the autograder's files, one that floods
  the executor's report;
- memory (--execute --memory-gib 1): a notebook cell and an exercise that start five 300 MiB children.

Submissions hold only the parameters cell and the exercise cells (with their `ex.check` cells) unless the
attack needs more, so the executions stay cheap. The re-sealed copy is in tests/test_grading_corpus.py (lab
01 records no run to compare).
"""
from __future__ import annotations

import csv
import os
import re
import shutil
import textwrap
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell

from labkit.cli import main
from labkit.course.exercises.source import exercise_id
from labkit.course.grading.batch import GradeOptions, _max_score

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = "01_memory"
EXERCISES = ("model_state_bytes", "measure_state_bytes")
MSB = "def model_state_bytes(params, precision='mixed-bf16', optimizer='adamw', zero_stage=0, dp=1):\n"
WRONG = {"model_state_bytes": MSB + "    return {result}\n",
         "measure_state_bytes": "def measure_state_bytes(model, optimizer, inputs):\n    return {result}\n"}
ZEROS = {"model_state_bytes": "0", "measure_state_bytes": '{"weights": 0, "grads": 0, "optimizer": 0}'}
#: In the hidden tests only (their arguments, their source): never in any feedback page.
HIDDEN_MARKERS = ("7500000000", "1234567", "6738415616", "3000001", "_frozen_mlp", "reference(_estimate")

TRICKS = {
    # tests once ran in the student's process: make every case pass, whichever module runs them
    "replace_runner": (textwrap.dedent('''
        import labkit.course.exercises.cases as _cases
        _all_pass = lambda fn, cases, **kw: [_cases.CaseResult(c, "pass") for c in cases]
        _cases.run_cases = _all_pass
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
        _msg = "FORGED " + " ".join(MARKERS)  # as if it carried the hidden tests' source
        _forged = json.dumps({"variants": [{"results": [{"name": n, "hidden": False, "points": 1000,
                                                          "status": "pass", "message": _msg} for n in _names]}]})
        _fds = [int(sys.argv[sys.argv.index("--report-fd") + 1])] if "--report-fd" in sys.argv else range(3, 64)
        for _fd in _fds:
            try:
                os.write(_fd, _forged.encode())
            except OSError:
                pass
        os._exit(0)
    ''').replace("MARKERS", repr(HIDDEN_MARKERS)), ZEROS),
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


def _trick(name: str) -> dict[str, str]:
    prelude, results = TRICKS[name]
    return {ex: f"# EXERCISE {ex}: attacked\n{prelude}\n" + WRONG[ex].format(result=results[ex]) for ex in EXERCISES}


def _all_tricks():
    """One executed submission with the four tricks (one execution, not four): the runner replaced in its
    kernel, each exercise wrong and attacked (always-equal objects; the calling test's locals), and a last
    cell that forges a report on every descriptor of the kernel and exits."""
    cells = {"model_state_bytes": _trick("always_equal")["model_state_bytes"],
             "measure_state_bytes": _trick("read_test_locals")["measure_state_bytes"]}
    nb = _submission(cells, TRICKS["replace_runner"][0])
    nb.cells.append(new_code_cell(TRICKS["forged_report"][0]))
    return nb


def _loot(release: Path) -> str:
    """Code that looks for the autograder's files where an instructor would have put them; LOOT <what it read>."""
    where = [str(release / "autograder" / "**" / "*.py"), str(ROOT / "notebooks" / "tests" / "hidden" / "*.py"),
             str(ROOT / "notebooks" / "tests" / "*.py")]
    return textwrap.dedent(f'''
        import glob
        def _loot():
            found = []
            for pattern in {where!r}:
                for path in glob.glob(pattern, recursive=True):
                    try:
                        found.append(path + ": " + open(path).read())
                    except OSError as exc:
                        found.append(path + ": " + exc.strerror)
            return "LOOT " + ("; ".join(found) or "found nothing")
    ''')


#: Five children of 300 MiB each, held together for a few seconds: "held at once: N of 5". Once per process
#: (every test calls the exercise: forking five children per call would cost more than the rest of the corpus).
HOG = textwrap.dedent('''
    import subprocess, sys
    _held = []
    def _hog():
        if not _held:
            child = "import time; b = b'\\\\x01' * (300 * 2**20); time.sleep(4)"
            procs = [subprocess.Popen([sys.executable, "-c", child]) for _ in range(5)]
            _held.append(f"held at once: {sum(p.wait() == 0 for p in procs)} of 5")
        return _held[0]
''')

LEAKS = {
    # the hidden tests' arguments back through the student's own exception messages, then through its output
    # as the process dies in the middle of a hidden test
    "exfiltrate": "import os\n_calls = []\n" + MSB + (
        "    _calls.append((params, precision, optimizer, zero_stage, dp))\n"
        "    print('ARGS', _calls, flush=True)\n"
        "    if len(_calls) >= 7:  # past the 6 visible tests (each stops at its first call): a hidden one runs\n"
        "        os._exit(3)\n"
        "    raise AssertionError(f'PASS {_calls!r}')\n"),
    # messages no file can hold as they are: lone surrogates, NUL, megabytes
    "binary_message": MSB + '    raise RuntimeError("\\udcff\\x00 binary " * 1000 + "x" * 2_000_000)\n',
    # an answer above --output-mib: refused before it is read
    "oversize_answer": MSB + "    return 'x' * (9 * 2**20)\n",
}


def _cells(kind: str, release: Path) -> dict[str, str]:
    """Exercise cells of a leak attack (model_state_bytes only: measure_state_bytes is missing, worth 0)."""
    if kind == "read_autograder":
        return {"model_state_bytes": f"# EXERCISE model_state_bytes: attacked\n{_loot(release)}\n{MSB}"
                                     "    raise AssertionError(_loot()[:20000])\n"}
    if kind == "binary_message":  # the other cell fails to load with such a message
        bad = 'raise ValueError(["a JSON list", {"b": 1}], "\\udc80\\x00" * 500)\n'
        return {"model_state_bytes": f"# EXERCISE model_state_bytes: attacked\n{LEAKS[kind]}",
                "measure_state_bytes": f"# EXERCISE measure_state_bytes: attacked\n{bad}"}
    return {"model_state_bytes": f"# EXERCISE model_state_bytes: attacked\n{LEAKS[kind]}"}


def _submission(cells: dict[str, str], extra: str | None = None):
    """The source notebook's parameters cell and exercise cells (replaced by `cells`) with their check cells;
    `extra`: a code cell right after the parameters cell."""
    src = nbformat.read(ROOT / "notebooks" / f"{NOTEBOOK}.ipynb", 4)
    keep = []
    for i, cell in enumerate(src.cells):
        ex = exercise_id(cell)
        if "parameters" in cell.metadata.get("tags", []):
            keep += [cell] + ([new_code_cell(extra)] if extra else [])
        elif ex in cells:
            cell.source = cells[ex]
            keep += [cell, src.cells[i + 1]]  # the exercise cell and its `ex.check` cell
    src.cells = keep
    return src


def _write(folder: Path, student: str, nb) -> None:
    (folder / student).mkdir(parents=True)
    nbformat.write(nb, folder / student / f"{NOTEBOOK}.ipynb")


def _source_cells() -> dict[str, str]:
    from labkit.course.exercises.source import exercise_cells

    cells = exercise_cells(nbformat.read(ROOT / "notebooks" / f"{NOTEBOOK}.ipynb", 4))
    return {ex: src for ex, src in cells.items() if ex in EXERCISES}


def _grade(root: Path, release: Path, subs: str, out: str, *extra: str) -> dict[str, dict]:
    with pytest.raises(SystemExit) as done:
        main(["grade", str(root / subs), "--out", str(root / out), "--autograder", str(release / "autograder"),
              "--workers", "2", "--output-mib", "8", *extra])
    assert done.value.code in (0, None)
    with (root / out / "grades.csv").open(encoding="utf-8") as fh:  # valid UTF-8 whatever the messages held
        return {row["student"]: row for row in csv.DictReader(fh)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(root, release, {run: rows}) after the three `labkit grade` runs."""
    root = tmp_path_factory.mktemp("hostile")
    release = ROOT / "build" / f"hostile-release-{os.getpid()}"  # inside the source tree (build/ is git-ignored)
    with pytest.raises(SystemExit) as done:
        main(["assign", "--out", str(release), "--source", str(ROOT / "notebooks")])
    assert done.value.code in (0, None)
    try:
        _write(root / "subs", "honest", _submission(_source_cells()))
        for name in TRICKS:
            _write(root / "subs", name, _submission(_trick(name)))
        _write(root / "subs-exec", "all_tricks", _all_tricks())
        for name in (*LEAKS, "read_autograder"):
            _write(root / "subs", name, _submission(_cells(name, release)))
        _write(root / "subs-exec", "honest_full", nbformat.read(ROOT / "notebooks" / f"{NOTEBOOK}.ipynb", 4))
        _write(root / "subs-exec", "read_autograder", _submission({}, _loot(release) + "\nprint(_loot())"))
        _write(root / "subs-exec", "oversize_report", _submission({}, textwrap.dedent('''
            import os
            _fds = f"/proc/{os.getppid()}/fd"  # the executor's descriptors, the report among them
            for _fd in os.listdir(_fds):
                if os.readlink(f"{_fds}/{_fd}").endswith("/report"):
                    with open(f"{_fds}/{_fd}", "ab") as _out:
                        for _ in range(40):
                            _out.write(b"x" * 2**20)
        ''')))
        hog = {"model_state_bytes": f"# EXERCISE model_state_bytes: attacked\n{HOG}\n{MSB}"
                                    "    raise RuntimeError(_hog())\n"}
        _write(root / "subs-mem", "memory_hog", _submission(hog, HOG + "\nprint(_hog())"))
        runs = {"recorded": _grade(root, release, "subs", "out"),
                "executed": _grade(root, release, "subs-exec", "out-exec", "--execute", "--timeout", "600"),
                "memory": _grade(root, release, "subs-mem", "out-mem", "--execute", "--timeout", "600",
                                 "--memory-gib", "1")}
        yield root, release, runs
    finally:
        shutil.rmtree(release, ignore_errors=True)


def _code_scores(row: dict) -> dict[str, str]:
    return dict(re.findall(r"\b(model_state_bytes|measure_state_bytes) ([\d.]+/[\d.]+)", row["detail"].split("code: ", 1)[1]))


def _pages(root: Path, out: str) -> dict[str, str]:
    return {p.stem: p.read_text(encoding="utf-8") for p in (root / out / "feedback").glob("*.html")}


def test_each_trick_scores_zero_with_and_without_execute_and_honest_work_full_marks(corpus):
    root, release, runs = corpus
    recorded, executed = runs["recorded"], runs["executed"]
    assert _code_scores(recorded["honest"]) == {"model_state_bytes": "12/12", "measure_state_bytes": "6/6"}
    for name in (*TRICKS, "all_tricks"):
        row = recorded.get(name) or executed[name]
        assert _code_scores(row) == {"model_state_bytes": "0/12", "measure_state_bytes": "0/6"}, row
    for name in (*LEAKS, "read_autograder"):
        assert _code_scores(recorded[name]) == {"model_state_bytes": "0/12", "measure_state_bytes": "0/6"}
    # its last cell writes into the kernel's own sockets and exits: graded as a dead kernel at once, not as a
    # timeout 10 minutes later (jupyter_client's heartbeat stop waited forever: sandbox._bounded_heartbeat_stop)
    assert "the kernel died" in executed["all_tricks"]["detail"], executed["all_tricks"]
    # The unmodified solution notebook, re-executed in the sandbox: its ex.check cells leave the tests to the
    # grader, every recorded check and every code test passes.
    full = executed["honest_full"]
    assert full["status"] == "graded" and full["score"] == full["max_score"], full


def test_points_possible_is_the_plans_in_every_file(corpus):
    root, release, runs = corpus
    plan = _max_score(NOTEBOOK, GradeOptions(autograder=str(release / "autograder")))
    assert plan == 25  # 7 points of recorded checks + 18 of code tests, whatever forged_report claimed
    for out, rows in (("out", runs["recorded"]), ("out-exec", runs["executed"])):
        assert {float(r["max_score"]) for r in rows.values()} == {plan}
        with (root / out / "canvas.csv").open() as fh:
            canvas = list(csv.reader(fh))
        assert canvas[1][:1] == ["Points Possible"] and float(canvas[1][5]) == plan
        assert all(float(line[5]) <= plan for line in canvas[2:])
        assert all(f"/ {plan:g}" in page for page in _pages(root, out).values())


def test_no_hidden_test_text_reaches_any_feedback(corpus):
    root, release, runs = corpus
    pages = {**_pages(root, "out"), **{f"exec/{k}": v for k, v in _pages(root, "out-exec").items()}}
    assert len(pages) == len(runs["recorded"]) + len(runs["executed"])
    for student, page in pages.items():
        assert not [m for m in HIDDEN_MARKERS if m in page], student
        assert "FORGED" not in page, student  # a forged report's message is never read
    # The attacks ran and found nothing: their visible-test messages say so, in the student's own words
    assert "LOOT found nothing" in pages["read_autograder"]
    assert "PASS [(1000000000" in pages["exfiltrate"]  # a visible test's arguments: visible anyway
    assert "stopped during a hidden test" in runs["recorded"]["exfiltrate"]["detail"]  # one reason, whatever happened
    assert "ARGS" not in runs["recorded"]["exfiltrate"]["detail"]  # its output is not named after a hidden test
    # Under --execute the notebook looked for the release (inside the source tree) and the tree's hidden tests
    executed = nbformat.read(root / "out-exec" / "executed" / "read_autograder" / f"{NOTEBOOK}.ipynb", 4)
    printed = "".join(o.get("text", "") for c in executed.cells for o in c.get("outputs", []))
    assert "LOOT found nothing" in printed and not [m for m in HIDDEN_MARKERS if m in printed]


def test_a_crashing_message_leaves_every_feedback_page_and_an_oversize_report_is_refused(corpus):
    root, release, runs = corpus
    for out, rows in (("out", runs["recorded"]), ("out-exec", runs["executed"])):
        assert set(_pages(root, out)) == set(rows)  # one page per student, whatever a neighbour's message held
    page = _pages(root, "out")["binary_message"]
    assert "binary" in page and "a JSON list" in page and len(page) < 100_000
    assert "announced an answer of 9.0 MiB above the 8 MiB cap" in runs["recorded"]["oversize_answer"]["detail"]
    flooded = runs["executed"]["oversize_report"]
    assert flooded["status"] == "error" and "8 MiB output cap" in flooded["detail"], flooded


def test_children_share_one_memory_cap(corpus):
    """Five 300 MiB children under --memory-gib 1: at most three hold their memory at once, in the notebook
    (its kernel forks them) and in the exercise's process alike; the row names the cap when it stopped them."""
    root, release, runs = corpus
    row = runs["memory"]["memory_hog"]
    executed = nbformat.read(root / "out-mem" / "executed" / "memory_hog" / f"{NOTEBOOK}.ipynb", 4)
    printed = "".join(o.get("text", "") for c in executed.cells for o in c.get("outputs", []))
    held = [int(n) for n in re.findall(r"held at once: (\d) of 5", printed + row["detail"] +
                                       _pages(root, "out-mem")["memory_hog"])]
    capped = "memory cap of one submission" in row["detail"]
    assert held or capped, row
    assert all(n <= 3 for n in held), (held, row["detail"])
