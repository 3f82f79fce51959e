"""Every code exercise of every notebook is tested, and its tests catch its mutants (issues #15, #30).

Generic over notebooks/tests/hidden/*.py, so a lab's new exercises are covered without touching this file.
A mutant marked visible (a 3-tuple in MUTANTS) must fail a VISIBLE test whose message names its fix:
the classic mistakes are caught where the student sees them, hidden tests only add cases.
Beside the mutants of the solution, every test meets the hollow answers of its exercise's `returns=` specs
(tests/_hollow.py: empty lists and dicts, zero-size tensors, None, NaN, a broadcastable wrong shape; issue #39)
and must fail each: they run in this process against the references the solution's run cached, so they cost
no student process and no rank.
The executed source notebooks' recorded checks are asserted in tests/test_notebooks.py, right after each run; the
code tests of their exercise cells (the same source) are this file's solution runs.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from _hollow import KINDS, hollow_student

from labkit.course.exercises import load_cases, load_mutants, run_cases
from labkit.course.exercises.cases import load_varies
from labkit.course.exercises.grading import plan_for, run_variants
from labkit.course.exercises.source import exercise_cells, regions

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "notebooks" / "tests"
HIDDEN = sorted((TESTS / "hidden").glob("*.py"))
#: Visible mutants every ported exercise declares (issue #30: "at least two, as mutants marked visible").
MIN_VISIBLE_MUTANTS = 2


def _exercises() -> list[tuple[str, str]]:
    """(notebook, exercise) for every exercise any test file or notebook cell names."""
    found = set()
    for path in sorted(TESTS.glob("*.py")) + HIDDEN:
        found |= {(path.stem, c.exercise) for c in load_cases(path)}
    for nb_path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        found |= {(nb_path.stem, ex) for ex in exercise_cells(nbformat.read(nb_path, 4))}
    return sorted(found)


EXERCISES = _exercises()


def test_the_pilot_lab_has_code_exercises_on_the_judge():
    assert {"model_state_bytes", "measure_state_bytes"} <= {ex for nb, ex in EXERCISES if nb == "01_memory"}


@pytest.mark.parametrize("notebook, exercise", EXERCISES, ids=[f"{n}-{e}" for n, e in EXERCISES])
def test_every_exercise_has_a_cell_visible_and_hidden_tests_and_mutants(notebook, exercise):
    cells = exercise_cells(nbformat.read(ROOT / "notebooks" / f"{notebook}.ipynb", 4))
    assert exercise in cells, f"notebooks/{notebook}.ipynb has no exercise cell for {exercise}"
    source = cells[exercise]
    assert regions(source, f"{notebook} {exercise}"), f"{exercise}: no # BEGIN SOLUTION region"
    assert f"def {exercise}(" in source, f"the {exercise} cell must define def {exercise}(...)"
    hidden = TESTS / "hidden" / f"{notebook}.py"
    for path, kind in ((TESTS / f"{notebook}.py", "visible"), (hidden, "hidden")):
        assert path.is_file() and any(c.exercise == exercise for c in load_cases(path)), \
            f"{exercise} needs a {kind} @case in {path.relative_to(ROOT)}"
    mutants = load_mutants(hidden).get(exercise, [])
    assert mutants, f"{exercise} needs >= 1 entry in MUTANTS of notebooks/tests/hidden/{notebook}.py"
    for m in mutants:
        assert m.fragment in source and m.fragment != m.replacement, \
            f"{exercise}: mutant fragment {m.fragment!r} not in its cell"
    visible = [m for m in mutants if m.visible]
    assert len(visible) >= MIN_VISIBLE_MUTANTS, (
        f"{exercise}: {len(visible)} visible mutants in MUTANTS of {hidden.relative_to(ROOT)}; write at least "
        f"{MIN_VISIBLE_MUTANTS} classic mistakes as (fragment, replacement, 'fix words') that a visible test names")
    assert load_varies(hidden).get(exercise), (
        f"{exercise}: no VARIES entry in {hidden.relative_to(ROOT)} (one line: what its hidden tests vary)")


@pytest.mark.slow
@pytest.mark.parametrize("notebook, exercise", EXERCISES, ids=[f"{n}-{e}" for n, e in EXERCISES])
def test_the_solution_passes_and_every_mutant_fails_a_test(notebook, exercise):
    """One student process per exercise serves the solution and every mutant, against the visible + hidden tests;
    a visible mutant fails a visible test whose message contains its fix words."""
    source = exercise_cells(nbformat.read(ROOT / "notebooks" / f"{notebook}.ipynb", 4))[exercise]
    mutants = load_mutants(TESTS / "hidden" / f"{notebook}.py")[exercise]
    variants = [source] + [source.replace(m.fragment, m.replacement) for m in mutants]
    plan = plan_for(notebook, TESTS, TESTS / "hidden")
    cache: dict = {}  # the references of the solution's run, read again by the hollow answers below
    solution, *mutated = run_variants(exercise, variants, plan, timeout_s=900, memory_bytes=16 * 2**30,
                                      output_bytes=2**24, cache=cache)
    assert not solution.error and all(r.status == "pass" for r in solution.results), solution
    for m, result in zip(mutants, mutated):
        failed = [r for r in result.results if r.status != "pass"]
        assert failed, f"{exercise}: no test fails when {m.fragment!r} becomes {m.replacement!r}"
        if m.visible:
            messages = [r.message for r in failed if not r.case.hidden]
            assert any(m.fix in text for text in messages), (
                f"{exercise}: mutant {m.replacement!r} must fail a visible test whose message says {m.fix!r}; "
                f"visible failures: {messages or 'none'}")
    for kind in KINDS:  # issue #39: a hollow answer fails every test it reaches
        results = run_cases(None, plan.cases(exercise), student=hollow_student(exercise, kind), cache=cache)
        passed = [r.case.name for r in results if r.status != "fail"]
        assert not passed, f"{exercise}: a {kind} answer (tests/_hollow.py) passes {passed}: validate it (expect.py)"
        broken = [r.message for r in results if r.message.startswith("NameError")]  # the test's own bug, not a verdict
        assert not broken, f"{exercise}: a test fails on a {kind} answer with {broken[0]!r}: fix the test file"
