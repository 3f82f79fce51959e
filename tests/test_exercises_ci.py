"""Every code exercise of every notebook is tested, and its tests catch its mutants (issue #15).

Generic over notebooks/tests/hidden/*.py, so a lab's new exercises are covered without touching this file.
The executed source notebooks' full marks are asserted in tests/test_notebooks.py, right after each run.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from labkit.course.exercises import load_cases, load_mutants
from labkit.course.exercises.runner import OK, run_exercise, payload_of
from labkit.course.exercises.source import exercise_cells, regions

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "notebooks" / "tests"
HIDDEN = sorted((TESTS / "hidden").glob("*.py"))


def _exercises() -> list[tuple[str, str]]:
    """(notebook, exercise) for every exercise any test file or notebook cell names."""
    found = set()
    for path in sorted(TESTS.glob("*.py")) + HIDDEN:
        found |= {(path.stem, c.exercise) for c in load_cases(path)}
    for nb_path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        found |= {(nb_path.stem, ex) for ex in exercise_cells(nbformat.read(nb_path, 4))}
    return sorted(found)


EXERCISES = _exercises()


def test_the_pilot_lab_has_code_exercises():
    assert {"model_state_bytes", "measure_state_bytes"} <= {ex for nb, ex in EXERCISES if nb == "01_memory"}


@pytest.mark.parametrize("notebook, exercise", EXERCISES, ids=[f"{n}-{e}" for n, e in EXERCISES])
def test_every_exercise_has_a_cell_visible_and_hidden_tests_and_mutants(notebook, exercise):
    cells = exercise_cells(nbformat.read(ROOT / "notebooks" / f"{notebook}.ipynb", 4))
    assert exercise in cells, f"notebooks/{notebook}.ipynb has no exercise cell for {exercise}"
    source = cells[exercise]
    assert regions(source, f"{notebook} {exercise}"), f"{exercise}: no # BEGIN SOLUTION region"
    assert f"def {exercise}(" in source, f"the {exercise} cell must define def {exercise}(...)"
    for path, kind in ((TESTS / f"{notebook}.py", "visible"), (TESTS / "hidden" / f"{notebook}.py", "hidden")):
        assert path.is_file() and any(c.exercise == exercise for c in load_cases(path)), \
            f"{exercise} needs a {kind} @case in {path.relative_to(ROOT)}"
    mutants = load_mutants(TESTS / "hidden" / f"{notebook}.py").get(exercise, [])
    assert mutants, f"{exercise} needs >= 1 entry in MUTANTS of notebooks/tests/hidden/{notebook}.py"
    for fragment, replacement in mutants:
        assert fragment in source and fragment != replacement, f"{exercise}: mutant fragment {fragment!r} not in its cell"


@pytest.mark.slow
@pytest.mark.parametrize("notebook, exercise", EXERCISES, ids=[f"{n}-{e}" for n, e in EXERCISES])
def test_the_solution_passes_and_every_mutant_fails_a_test(notebook, exercise):
    """One process per exercise: the solution, then each mutant, against the visible + hidden tests."""
    source = exercise_cells(nbformat.read(ROOT / "notebooks" / f"{notebook}.ipynb", 4))[exercise]
    mutants = load_mutants(TESTS / "hidden" / f"{notebook}.py")[exercise]
    variants = [source] + [source.replace(fragment, replacement) for fragment, replacement in mutants]
    tests = payload_of([TESTS / f"{notebook}.py"], False) + payload_of([TESTS / "hidden" / f"{notebook}.py"], True)
    run = run_exercise(exercise, variants, tests, timeout_s=900, memory_bytes=16 * 2**30, output_bytes=2**24,
                       reveal_hidden=True)
    assert run.status == OK, run.reason
    solution, *mutated = run.variants
    assert "results" in solution and all(r["status"] == "pass" for r in solution["results"]), solution
    for (fragment, replacement), result in zip(mutants, mutated):
        failed = "error" in result or any(r["status"] != "pass" for r in result["results"])
        assert failed, f"{exercise}: no test fails when {fragment!r} becomes {replacement!r}"
