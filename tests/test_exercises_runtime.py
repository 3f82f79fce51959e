"""The exercise runtime (labkit.course.exercises): cases, check/attempt, spawn (issue #15)."""
from __future__ import annotations

import re
import textwrap
from types import SimpleNamespace

import pytest

from conftest import command_line, live_children, stream_text
from labkit.course import exercises as ex

TESTS = textwrap.dedent('''
    from labkit.course.exercises import case, trusted_spawn

    def _rank_sum(rank, world, square):
        import torch, torch.distributed as dist
        t = torch.tensor([float(square(rank + 1))])
        dist.all_reduce(t)
        return t.item()

    def _reference_sum(rank, world):
        return float(sum((r + 1) ** 2 for r in range(world)))

    @case("square", points=2)
    def small_numbers(student):
        got = student.call(3, returns=int)
        assert got == 9, f"square(3) = {got}, expected 9"

    @case("square")
    def negative(student):
        assert student.call(-2, returns=int) == 4

    @case("square")
    def on_two_ranks(student):
        assert student.spawn(_rank_sum, world=2, returns=float) == trusted_spawn(_reference_sum, world=2)

    @case("other")
    def not_mine(student):
        raise AssertionError("never run for square")
''')
HIDDEN = textwrap.dedent('''
    from labkit.course.exercises import case

    VARIES = {"square": "other magnitudes"}

    @case("square", points=3)
    def secret(student):
        assert student.call(12345, returns=int) == 152399025, "SECRET 12345"

    MUTANTS = {"square": [("x * x", "x + x", "expected 9"), ("x * x", "abs(x) * x")]}
''')


@pytest.fixture
def tests_dir(tmp_path, monkeypatch):
    (tmp_path / "tests" / "hidden").mkdir(parents=True)
    (tmp_path / "tests" / "01_x.py").write_text(TESTS)
    (tmp_path / "tests" / "hidden" / "01_x.py").write_text(HIDDEN)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "tests"


def test_case_rejects_a_bad_id_and_points():
    with pytest.raises(ValueError, match="function's name"):
        ex.case("not an id")
    with pytest.raises(ValueError, match="points must be > 0"):
        ex.case("square", points=0)


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_check_finds_the_visible_tests_and_says_what_the_hidden_ones_vary(tests_dir, capsys):
    """One spawn in the right answer's run (the student's ranks) and one trusted reference spawn."""
    def square(x):
        return x * x

    ex.check(square)
    out = capsys.readouterr().out
    assert "square: 3/3 tests pass" in out
    assert "PASS small_numbers (2 pts)" in out and "PASS on_two_ranks (1 pt)" in out
    assert "not_mine" not in out
    # tests/hidden/ beside the visible tests is a learner's own copy (`make student`): its hidden tests are theirs
    assert ("+ 1 hidden test (3 pts) in your copy's tests/hidden/ (`labkit check` runs them): "
            "they vary other magnitudes") in out
    assert "SECRET" not in out and "secret" not in out and "12345" not in out


def test_check_reports_failures_with_their_message_and_a_stub_as_not_attempted(tests_dir, capsys):
    def square(x):
        return abs(x) * 2  # right for +-2 only

    results = ex.run_cases(square, [c for c in ex.load_cases(tests_dir / "01_x.py") if c.name != "on_two_ranks"
                                    and c.exercise == "square"])
    assert [r.status for r in results] == ["fail", "pass"]
    assert "square(3) = 6, expected 9" in results[0].message

    def square(x):  # noqa: F811 - the release's stub
        raise NotImplementedError("exercise square: return x squared")

    ex.check(square, tests=tests_dir / "01_x.py")
    assert "square: not attempted (exercise square: return x squared)" in capsys.readouterr().out


def test_a_bare_assert_names_its_line_and_a_hidden_failure_hides_its_message(tmp_path):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "01_x.py").write_text("from labkit.course.exercises import case\n"
                                    "@case('square')\ndef secret(student):\n"
                                    "    assert student.call(12345, returns=int) == 152399025\n"
                                    "MUTANTS = {'square': [('x * x', 'x + x'), ('x * x', '0', 'fix words')]}\n")
    cases = ex.load_cases(hidden / "01_x.py")
    assert cases[0].hidden
    results = ex.run_cases(lambda x: 0, cases)
    assert "01_x.py:4: assert student.call(12345, returns=int) == 152399025" in results[0].message
    text = ex.report("square", results)
    assert "FAIL hidden test secret" in text and "12345" not in text
    assert ex.load_mutants(hidden / "01_x.py") == {"square": [ex.Mutant("x * x", "x + x"),
                                                              ex.Mutant("x * x", "0", "fix words")]}


def test_check_without_tests_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ex.ExerciseError, match="no tests/ folder beside this notebook"):
        ex.check(lambda x: x)


def test_attempt_returns_none_on_the_stub_and_reraises_real_errors(capsys):
    def stub():
        raise NotImplementedError("exercise f: write it")

    assert ex.attempt(stub) is None
    assert "not attempted yet: exercise f: write it" in capsys.readouterr().out
    assert ex.attempt(lambda a, b=0: a + b, 1, b=2) == 3
    with pytest.raises(ZeroDivisionError):
        ex.attempt(lambda: 1 / 0)


def _rank_fails(rank, world):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one is wrong")
    dist.barrier()  # rank 0 would wait here forever: spawn must kill it


def _already_imported(rank, world, name):
    import sys

    return name in sys.modules


def _rank_count(rank, world):
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


def _rank_stub(rank, world):
    raise NotImplementedError("exercise f: write it")


def _rank_hangs(rank, world):
    import time

    import torch.distributed as dist

    if rank == 0:
        dist.barrier()  # rank 1 never joins...
    else:
        time.sleep(3600)  # ...and never exits either (an exiting peer would make gloo raise on rank 0 instead)


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_spawn_names_the_failing_rank_and_its_error_and_leaves_no_process():
    with pytest.raises(ex.ExerciseError, match=r"rank 1 raised ValueError: rank one is wrong") as info:
        ex.spawn(_rank_fails, world=2, timeout=60)
    assert info.value.rank == 1 and "raise ValueError" in info.value.traceback
    assert not info.value.not_attempted
    assert live_children() == []


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_spawn_marks_a_stub_in_a_rank_as_not_attempted(capsys):
    assert ex.attempt(ex.spawn, _rank_stub, world=2, timeout=60) is None
    assert re.search(r"not attempted yet: rank [01] raised NotImplementedError: exercise f: write it",
                     capsys.readouterr().out)


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_spawn_kills_a_hung_run_at_the_timeout():
    with pytest.raises(ex.ExerciseError, match=r"still running after 4 s and was killed"):
        ex.spawn(_rank_hangs, world=2, timeout=4)
    assert live_children() == []


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_spawn_starts_again_on_a_new_port_when_its_port_was_taken(monkeypatch):
    """free_port() can lose its port to another job before rank 0 binds it: spawn tries a new one. Ranks
    forked from warm_ranks()' forkserver (4 fresh interpreters importing torch cost twice as much); the
    retry is `spawn`'s own, the same for fresh ranks (their start is tested above)."""
    import socket
    import sys

    warm_ranks = sys.modules["labkit.course.exercises.spawn"].warm_ranks

    from labkit.runtime import launch

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda *a: ports.pop(0) if ports else real(*a))
    try:
        with warm_ranks():
            assert ex.spawn(_rank_count, world=2) == [2, 2]
    finally:
        taken.close()
    assert ports == [] and live_children() == []


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_warm_ranks_are_forks_of_one_process_and_behave_like_fresh_ones():
    """Inside warm_ranks() (the grader's process for one exercise) ranks fork from one forkserver: the same
    values, the failing rank named, a hung run killed, a fresh process group per spawn; nothing left after."""
    import sys

    spawn_module = sys.modules["labkit.course.exercises.spawn"]
    with spawn_module.warm_ranks():
        assert ex.spawn(_rank_count, world=2) == [2, 2]
        assert ex.spawn(_rank_count, world=3) == [3, 3, 3]  # a new group of another size: ranks are not reused
        forkserver = [p for p in live_children() if "forkserver" in command_line(p)]
        assert len(forkserver) == 1, live_children()
        with pytest.raises(ex.ExerciseError, match=r"rank 1 raised ValueError: rank one is wrong") as info:
            ex.spawn(_rank_fails, world=2, timeout=60)
        assert "raise ValueError" in info.value.traceback
        with pytest.raises(ex.ExerciseError, match=r"still running after 4 s and was killed"):
            ex.spawn(_rank_hangs, world=2, timeout=4)
        assert [p.pid for p in live_children()] == \
            [forkserver[0].pid]  # every rank is gone; only the forkserver waits for the next spawn
        # A spawn that names heavy imports gets ranks forked from a forkserver that imported them (started
        # anew: the old one had not); a module that does not import is skipped; later spawns keep them.
        assert ex.spawn(_already_imported, world=2, args=("xml.dom.minidom",)) == [False, False]
        assert ex.spawn(_already_imported, world=2, args=("xml.dom.minidom",),
                        imports=("xml.dom.minidom", "no_such_module_for_labkit")) == [True, True]
        assert ex.spawn(_already_imported, world=2, args=("xml.dom.minidom",)) == [True, True]
        again = [p for p in live_children() if "forkserver" in command_line(p)]
        assert len(again) == 1 and again[0].pid != forkserver[0].pid, live_children()
    assert spawn_module._WARM is None and live_children() == []


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_in_a_kernel_ranks_fork_from_a_forkserver_that_lives_as_long_as_the_kernel(run_cells):
    nb = run_cells(
        "import os\nfrom labkit.course.exercises import spawn\n"
        "def where(rank, world):\n"
        "    import torch.distributed as dist\n"
        "    return open(f'/proc/{os.getppid()}/cmdline').read().replace(chr(0), ' '), dist.get_world_size()\n"
        "first = spawn(where, world=2)\nsecond = spawn(where, world=2)",
        "print([(('forkserver' in parent), size) for parent, size in first + second])")
    assert stream_text(nb.cells[1]).strip() == str([(True, 2)] * 4)


def test_spawn_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world=0"):
        ex.spawn(_rank_stub, world=0)
    with pytest.raises(ValueError, match="timeout=0"):
        ex.spawn(_rank_stub, timeout=0)


# ---------------------------------------------------------------- exercise cells and their markers
CELL = '''# EXERCISE halve: halve it
%time import math

def halve(x):
    """Half of x."""
    # BEGIN SOLUTION
    y = x / 2
    return y
    # END SOLUTION

answer_value = 42  # SOLUTION
'''


def test_stub_replaces_each_region_at_its_indent_and_one_line_answers_by_none():
    from labkit.course.exercises.source import solution_lines, stub

    out = stub(CELL, "halve")
    assert '    """Half of x."""\n    raise NotImplementedError("exercise halve: write your code here")\n' in out
    assert "answer_value = None  # YOUR ANSWER" in out
    assert not any(line in out for line in solution_lines(CELL))
    assert solution_lines(CELL) == ["    y = x / 2", "    return y", "answer_value = 42  # SOLUTION"]


def test_exercise_cells_come_from_metadata_or_the_header_line_and_magics_run_as_python():
    from nbformat.v4 import new_code_cell, new_notebook

    from labkit.course.exercises.source import exercise_cells, to_python

    nb = new_notebook(cells=[new_code_cell(CELL), new_code_cell("def g():\n    pass", metadata={"labkit": {"exercise": "g"}}),
                             new_code_cell("x = 1")])
    assert list(exercise_cells(nb)) == ["halve", "g"]
    # The %time line becomes get_ipython().run_line_magic(...): a stand-in shell runs it here, so no global
    # IPython is left behind for later tests (a live shell changes what a seal records).
    namespace = {}
    namespace["get_ipython"] = lambda: SimpleNamespace(run_line_magic=lambda name, line: exec(line, namespace))
    exec(to_python(CELL), namespace)
    assert namespace["halve"](3) == 1.5
