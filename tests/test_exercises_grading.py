"""`labkit grade` / `labkit check` on code exercises: a hostile corpus of tiny submissions (issues #15, #26).

One batch grades five students' cells of two exercises in the sandbox, one process per exercise: a right
answer, a partly wrong one, a hang, a crash and a 100 MB print. Each bad exercise gets 0 and a reason; the
other exercise of the same student is still graded; feedback never shows a hidden test's message or inputs.
"""
from __future__ import annotations

import csv
import textwrap

import nbformat
import pytest
from click.testing import CliRunner
from nbformat.v4 import new_code_cell, new_notebook

from labkit.cli import cli
from labkit.course.grading import registry
from labkit.course.grading.batch import GradeOptions, run_batch
from labkit.course.grading.checks import relation

NB = "99_exercises"
VISIBLE = '''
from labkit.course.exercises import case

@case("double", points=2)
def small(student):
    got = student.call(3, returns=int)
    assert got == 6, f"double(3) = {got}, expected 6"

@case("triple")
def one(student):
    got = student.call(1, returns=int)
    assert got == 3, f"triple(1) = {got}"
'''
HIDDEN = '''
from labkit.course.exercises import case

@case("double", points=3)
def large(student):
    got = student.call(987654, returns=int)
    assert got == 1975308, f"SECRET double(987654) = {got}"

@case("triple")
def negative(student):
    assert student.call(-5, returns=int) == -15, "SECRET triple(-5)"
'''
RIGHT_TRIPLE = "def triple(x):\n    return 3 * x\n"


def _cell(ex_id, body):
    return new_code_cell(f"# EXERCISE {ex_id}: do it\n{textwrap.dedent(body)}", metadata={"labkit": {"exercise": ex_id}})


def _notebook(double: str | None, triple: str = RIGHT_TRIPLE):
    cells = [new_code_cell('PROFILE = "smoke"', metadata={"tags": ["parameters"]})]
    if double is not None:
        cells.append(_cell("double", double))
    cells.append(_cell("triple", triple))
    return new_notebook(cells=cells, metadata={"labkit": {"notebook": NB}})


SUBMISSIONS = {
    "good": _notebook("def double(x):\n    return 2 * x\n"),
    "partial": _notebook("def double(x):\n    return 2 * x if x < 1000 else 0\n",
                         "def triple(x):\n    raise NotImplementedError('exercise triple: write it')\n"),
    "hang": _notebook("def double(x):\n    while True:\n        pass\n"),
    "crash": _notebook("import os\n\ndef double(x):\n    os._exit(3)\n"),
    "bigprint": _notebook("def double(x):\n    print('x' * 100_000_000)\n    return 2 * x\n"),
    "nocell": _notebook(None),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("exercises")
    (root / "ag" / "visible").mkdir(parents=True)
    (root / "ag" / "visible" / f"{NB}.py").write_text(VISIBLE)
    (root / "ag" / f"{NB}.py").write_text(HIDDEN)
    for student, nb in SUBMISSIONS.items():
        (root / "subs" / student).mkdir(parents=True)
        nbformat.write(nb, str(root / "subs" / student / f"{NB}.ipynb"))
    registry.register(NB, (relation("always", 1, lambda ev: True),))
    opts = GradeOptions(autograder=str(root / "ag"), exercise_timeout_s=8.0, workers=2)
    result = run_batch(root / "subs", root / "out", opts)
    yield root, {r.student: r for r in result.rows}
    registry.unregister(NB)


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_every_exercise_gets_its_own_score_and_reason(graded):
    root, rows = graded
    assert {s: (r.status, r.score, r.max_score) for s, r in rows.items()} == {
        "good": ("graded", 8, 8), "partial": ("graded", 3, 8), "hang": ("graded", 3, 8),
        "crash": ("graded", 3, 8), "bigprint": ("graded", 3, 8), "nocell": ("graded", 3, 8)}
    assert "double 2/5; triple 0/2 (not attempted)" in rows["partial"].detail
    assert "double 0/5 (error: still running after 8 s" in rows["hang"].detail
    assert "triple 2/2" in rows["hang"].detail  # the batch went on after the hang
    assert "double 0/5 (error: the exercise's process died (exit code 3) before answering)" in rows["crash"].detail
    assert "double 0/5 (error: printed more than 50 MiB" in rows["bigprint"].detail
    assert "double 0/5 (missing: no exercise cell defines double" in rows["nocell"].detail
    with (root / "out" / "grades.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == len(SUBMISSIONS)


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_feedback_names_a_failed_hidden_test_but_never_its_message_or_inputs(graded):
    root, rows = graded
    page = (root / "out" / "feedback" / "partial.html").read_text()
    assert "double: large" in page and "double: small" in page
    assert "SECRET" not in page and "987654" not in page and "1975308" not in page
    assert not any("SECRET" in r.message for r in rows["partial"].results)
    hidden = next(r for r in rows["partial"].results if r.name == "double: large")
    assert not hidden.passed and not hidden.visible


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_check_lists_what_to_do_and_exits_1_then_0_when_done(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / f"{NB}.py").write_text(VISIBLE)
    registry.register(NB, (relation("always", 1, lambda ev: True),))
    try:
        todo, done = tmp_path / "todo.ipynb", tmp_path / "done.ipynb"
        nbformat.write(SUBMISSIONS["partial"], str(todo))
        nbformat.write(SUBMISSIONS["good"], str(done))
        out = CliRunner().invoke(cli, ["check", str(todo), "--timeout", "60"])
        assert out.exit_code == 1, out.output
        assert "code exercises: 1/2 pass their visible tests" in out.output
        assert "TODO  triple: not attempted" in out.output
        out = CliRunner().invoke(cli, ["check", str(done), "--timeout", "60"])
        assert out.exit_code == 0, out.output
        assert "PASS  double: 1/1 tests pass" in out.output and "SECRET" not in out.output
    finally:
        registry.unregister(NB)


RANK_TEST = '''
from labkit.course.exercises import Tensor, case, trusted_spawn

def _mine(rank, world, average):
    import torch
    return average(torch.arange(3.0) * (rank + 1))

def _theirs(rank, world):
    import torch
    import torch.distributed as dist
    t = torch.arange(3.0) * (rank + 1)
    dist.all_reduce(t)
    return t / world

@case("average")
def three_ranks(student):
    import torch
    want = trusted_spawn(_theirs, world=3)
    for rank, got in enumerate(student.spawn(_mine, world=3, returns=Tensor("float32", (3,)))):
        err = float((got - want[rank]).abs().max())
        assert err < 1e-6, f"rank {rank} of 3: yours differs from all_reduce / world by {err:.2e}"
'''


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_multi_rank_code_runs_inside_the_grading_sandbox_beside_a_trusted_reference():
    """The student's gloo ranks rendezvous on the sandbox's loopback (own network namespace) under its memory
    cap; the reference ranks run outside it and never load the student's cell. A wrong average (no division:
    the classic mistake) fails on the grader's side with its message."""
    from labkit.course.exercises.cases import load_cases_from_text
    from labkit.course.exercises.judge import judge
    from labkit.course.grading.isolation import detect

    cell = "import torch.distributed as dist\n\ndef average(t):\n    dist.all_reduce(t)\n    return t / dist.get_world_size()\n"
    cases = load_cases_from_text(RANK_TEST, "t.py", hidden=False)
    right, wrong = judge("average", [cell, cell.replace(" / dist.get_world_size()", "")], cases, timeout_s=300,
                         memory_bytes=8 * 2**30, output_bytes=2**20, isolation=detect())
    assert [r.status for r in right.results] == ["pass"], right
    assert wrong.results[0].status == "fail" and "rank 0 of 3: yours differs from all_reduce / world by 8.00e+00" \
        in wrong.results[0].message


SLOW_REFERENCE_TEST = '''
import time
from labkit.course.exercises import case, reference

def _slow_answer():
    time.sleep(4.0)
    return 6

@case("double")
def after_a_slow_reference(student):
    want = reference(_slow_answer)
    assert student.call(3, returns=int) == want, "double(3) is not 6"
'''


@pytest.mark.slow  # starts the student's process
def test_a_slow_reference_never_uses_up_the_students_time():
    """The grader's own work (a reference, a trusted spawn, waiting for its lock) extends the student's
    deadline: a 4 s reference beside a 2 s limit still grades the student's instant answer (05's 2-rank
    DeepSpeed reference used to leave the next student call 'still running after 300 s')."""
    from labkit.course.exercises.cases import load_cases_from_text
    from labkit.course.exercises.judge import judge
    from labkit.course.grading.isolation import detect

    cases = load_cases_from_text(SLOW_REFERENCE_TEST, "t.py", hidden=False)
    (result,) = judge("double", ["def double(x):\n    return 2 * x\n"], cases, timeout_s=2,
                      memory_bytes=2 * 2**30, output_bytes=2**20, isolation=detect())
    assert [r.status for r in result.results] == ["pass"], result
