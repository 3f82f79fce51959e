"""The next exercise's process started ahead, warm processes, nothing left running (issue #39, item 7).

`grade_exercises` starts exercise k+1's process while exercise k's tests run (one ahead at most), a process
whose tests spawn imports torch and starts its forkserver before it says it is ready (`cases.spawn_imports` reads
that from the tests' code), and every process it started is gone when it returns, on Ctrl-C too.
"""
from __future__ import annotations

import os
import textwrap

import pytest
from nbformat.v4 import new_code_cell, new_notebook

from conftest import command_line, live_children
from labkit.course.exercises.cases import load_cases_from_text, spawn_imports
from labkit.course.exercises.grading import grade_exercises, plan_for

NB = "98_ahead"
SERVER = "labkit.course.exercises.server"
TESTS = '''
import os

import psutil

from labkit.course.exercises import case, reference


def _made():
    """A reference: counted where the test asks (LABKIT_TEST_REFERENCES), so sharing can be seen."""
    if os.environ.get("LABKIT_TEST_REFERENCES"):
        with open(os.environ["LABKIT_TEST_REFERENCES"], "a") as f:
            f.write("made\\n")
    return 1


def _servers():
    """Exercise processes below this one; a zombie or a process that just ended (another test's) is none."""
    count = 0
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            count += "labkit.course.exercises.server" in " ".join(p.cmdline())
        except psutil.Error:
            pass
    return count


def _ranks(rank, world, fn):
    return fn(rank)


@case("first")
def warm_and_one_ahead(student):
    assert _servers() == 2, f"{_servers()} exercise processes while the first one's tests run, expected 2"
    assert student.call(returns=bool), "torch was not imported before the cell of an exercise that spawns"
    assert student.spawn(_ranks, world=2, returns=int) == [0, 10]
    assert reference(_made) == 1


@case("second")
def alone_and_cold(student):
    assert student.call(returns=bool) is False, "the second exercise's process saw the first's cell, or was warm"
    assert reference(_made) == 1
'''
CELLS = {
    "first": "import builtins\nimport sys\nbuiltins.FIRST_WAS_HERE = True\nWARM = 'torch' in sys.modules\n\n"
             "def first(rank=None):\n    return WARM if rank is None else 10 * rank\n",
    "second": "import builtins\nimport sys\nSEEN = hasattr(builtins, 'FIRST_WAS_HERE') or 'torch' in sys.modules\n\n"
              "def second():\n    return SEEN\n",
}


def _notebook():
    cells = [new_code_cell('PROFILE = "smoke"', metadata={"tags": ["parameters"]})]
    cells += [new_code_cell(f"# EXERCISE {ex}: write it\n{body}", metadata={"labkit": {"exercise": ex}})
              for ex, body in CELLS.items()]
    return new_notebook(cells=cells, metadata={"labkit": {"notebook": NB}})


def test_spawns_is_read_from_the_tests_code_through_helpers_and_lambdas():
    text = textwrap.dedent('''
        from labkit.course.exercises import case, trusted_spawn

        def _helper(student):
            return student.spawn(print, world=2, returns=[None])

        @case("direct")
        def direct(student):
            student.spawn(print, world=2, returns=[None])

        @case("helper")
        def through_a_helper(student):
            _helper(student)

        @case("lambda")
        def in_a_lambda(student):
            (lambda: student.spawn(print, world=2, returns=[None]))()

        @case("plain")
        def calls_only(student):
            student.call(1, returns=int)
            trusted_spawn(print, world=2)
    ''')
    cases = {c.exercise: c for c in load_cases_from_text(text, "98_spawns.py", hidden=False)}
    assert [ex for ex, c in cases.items() if spawn_imports([c]) is not None] == ["direct", "helper", "lambda"]
    assert spawn_imports(list(cases.values())) is not None and spawn_imports([]) is None



def test_the_modules_a_spawn_imports_are_read_too_so_the_process_ahead_preloads_them():
    """04's shard_model spawns with imports=LLAMA: the process started ahead gives its forkserver Llama's module
    before its turn (04's whole lab 23-30 s -> 11 s idle, bench/check_speed.py); a tuple that is not module names,
    or a spawn without `imports=`, adds nothing."""
    from pathlib import Path

    from labkit.course.exercises.grading import plan_for

    text = textwrap.dedent('''
        from labkit.course.exercises import case

        MODS = ("json", "email.message")
        WORDS = ("not a module", "x")

        @case("mods")
        def with_imports(student):
            student.spawn(print, world=2, returns=[None], imports=MODS)

        @case("words")
        def words_only(student):
            student.spawn(print, world=2, returns=[None], args=WORDS)

        @case("none")
        def no_spawn(student):
            student.call(MODS, returns=int)
    ''')
    cases = {c.exercise: c for c in load_cases_from_text(text, "98_imports.py", hidden=False)}
    assert [spawn_imports([cases[e]]) for e in ("mods", "words", "none")] == [("json", "email.message"), (), None]
    plan = plan_for("04_fsdp", Path(__file__).resolve().parent.parent / "notebooks" / "tests")
    assert spawn_imports(plan.cases("shard_model")) == ("transformers.models.llama.modeling_llama",)
    assert spawn_imports(plan.cases("zero1_step")) == ()

@pytest.mark.slow
def test_the_next_process_starts_ahead_each_is_its_own_and_none_outlives_grade_exercises(tmp_path, monkeypatch):
    """... and the exercises of one notebook share its references (08's recorded trace was made twice)."""
    (tmp_path / f"{NB}.py").write_text(TESTS)
    monkeypatch.setenv("LABKIT_TEST_REFERENCES", str(tmp_path / "references.txt"))
    zombie = os.fork()  # a child another test left unreaped (CI met one): counting processes must survive it
    if zombie == 0:
        os._exit(0)
    try:
        before = {p.pid for p in live_children()}
        grades = grade_exercises(_notebook(), NB, plan_for(NB, tmp_path), timeout_s=120)
    finally:
        os.waitpid(zombie, 0)
    assert [(g.exercise, g.status, g.reason) for g in grades] == [("first", "pass", ""), ("second", "pass", "")], \
        [r.message for g in grades for r in g.results]
    left = [command_line(p)[:120] for p in live_children() if p.pid not in before]
    assert not left, f"still running after grade_exercises returned: {left}"
    assert (tmp_path / "references.txt").read_text() == "made\n", "each exercise computed the reference again"


@pytest.mark.slow
def test_ctrl_c_during_a_test_kills_the_process_started_ahead(tmp_path):
    (tmp_path / f"{NB}.py").write_text(TESTS.replace(
        '    assert _servers() == 2, f"{_servers()}', '    if _servers() == 2:\n        raise KeyboardInterrupt\n'
        '    assert False, f"{_servers()}'))
    before = {p.pid for p in live_children()}
    with pytest.raises(KeyboardInterrupt):
        grade_exercises(_notebook(), NB, plan_for(NB, tmp_path), timeout_s=120)
    left = [command_line(p)[:120] for p in live_children() if p.pid not in before]
    assert not left, f"still running after an interrupted grade_exercises: {left}"
