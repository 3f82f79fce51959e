"""`labkit assign`: the student release holds no solution, runs unattempted, and `labkit check` lists the work."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import nbformat
import pytest

from conftest import stream_text
from labkit.cli import main
from labkit.course import notebooks as nbk
from labkit.course.exercises.release import make_release
from labkit.course.exercises.source import exercise_id, solution_lines

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "notebooks"


def released_memory_run(tmp_path_factory):
    """(release folder, NotebookRun): the student release with its 01_memory executed in smoke, once per process.
    This test checks it runs unattempted; tests/test_site.py imports this function to show its outputs on the
    course website (importing it keeps both files in one xdist unit, tests/_schedule.py: one run, not two)."""
    return _released_memory_run(tmp_path_factory.getbasetemp())


@functools.cache
def _released_memory_run(base: Path):
    out = base / "release-run"
    make_release(out, SOURCE)
    return out, nbk.run_notebook(out / "notebooks" / "01_memory.ipynb", out_dir=out / "executed")


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    out = tmp_path_factory.mktemp("release")
    return out, make_release(out, SOURCE)


def test_the_release_holds_no_solution_line_and_no_hidden_test(release):
    out, rel = release
    assert rel.exercises and len(rel.notebooks) == len(list(SOURCE.glob("*.ipynb")))
    for path in sorted(SOURCE.glob("*.ipynb")):
        src, got = nbformat.read(path, 4), nbformat.read(out / "notebooks" / path.name, 4)
        assert len(src.cells) == len(got.cells)
        for i, (a, b) in enumerate(zip(src.cells, got.cells)):
            if a.cell_type != "code":
                continue
            assert b.outputs == [] and b.execution_count is None
            leaked = [line for line in solution_lines(a.source) if line.strip() in
                      {x.strip() for x in b.source.splitlines()}]
            assert not leaked, f"{path.name} cell {i + 1} keeps solution lines {leaked}"
            assert "BEGIN SOLUTION" not in b.source and "# SOLUTION" not in b.source
            if exercise_id(a):
                assert f'raise NotImplementedError("exercise {exercise_id(a)}: ' in b.source
    hidden = {p.name for p in (SOURCE / "tests" / "hidden").glob("*.py")}
    assert {p.name for p in (out / "autograder").glob("*.py")} == hidden
    assert not list((out / "notebooks").rglob("hidden"))
    assert {p.name for p in (out / "notebooks" / "tests").glob("*.py")} == \
        {p.name for p in (SOURCE / "tests").glob("*.py")} == {p.name for p in (out / "autograder" / "visible").glob("*.py")}
    # what students may know of the hidden tests: how many, their points, what they vary; never their content
    manifest = json.loads((out / "notebooks" / "tests" / "01_memory.hidden.json").read_text())
    assert manifest["model_state_bytes"]["tests"] == 2 and "mixed-fp16" in manifest["model_state_bytes"]["varies"]
    hidden_text = (SOURCE / "tests" / "hidden" / "01_memory.py").read_text()
    assert "agrees_with_the_estimator" in hidden_text and "agrees_with_the_estimator" not in json.dumps(manifest)


def test_hidden_files_load_their_visible_twin_in_the_release_and_the_source_tree(release, tmp_path):
    """A hidden file reuses its visible file's harnesses (`visible_twin`): autograder/NN.py finds
    autograder/visible/NN.py, notebooks/tests/hidden/NN.py finds notebooks/tests/NN.py."""
    from labkit.course.exercises.cases import ExerciseError, load_cases, visible_twin

    out, _ = release
    for hidden in (out / "autograder" / "07_model_parallel.py", SOURCE / "tests" / "hidden" / "07_model_parallel.py"):
        assert {c.exercise for c in load_cases(hidden)} >= {"column_parallel", "gpipe_step"}
    twin = visible_twin(out / "autograder" / "07_model_parallel.py")
    assert twin.__labkit_test_file__ == str(out / "autograder" / "visible" / "07_model_parallel.py")
    (tmp_path / "hidden").mkdir()
    with pytest.raises(ExerciseError, match="no visible test file 09_x.py"):
        visible_twin(tmp_path / "hidden" / "09_x.py")


@pytest.mark.parametrize("source, error", [
    ("def f():\n    # BEGIN SOLUTION\n    return 1\n", "BEGIN SOLUTION is never closed"),
    ("def f():\n    return 1\n    # END SOLUTION\n", "END SOLUTION without a # BEGIN SOLUTION"),
    ("def f():\n    # BEGIN SOLUTION\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION\n", "inside the region"),
    ("# BEGIN SOLUTION\nx = 1\n# END SOLUTION\n", "must sit inside a function body"),
])
def test_assign_refuses_bad_markers_in_one_line(tmp_path, capsys, source, error):
    (tmp_path / "src").mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    nbformat.write(nb, str(tmp_path / "src" / "01_x.ipynb"))
    with pytest.raises(SystemExit) as exit_:
        main(["assign", "--out", str(tmp_path / "out"), "--source", str(tmp_path / "src")])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert "01_x.ipynb cell 1, line" in err and error in err
    assert not (tmp_path / "out" / "notebooks").exists()  # nothing written


def test_assign_never_overwrites_the_source(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["assign", "--out", str(ROOT), "--source", str(SOURCE)])
    assert exit_.value.code == 2 and "would overwrite the source notebooks" in capsys.readouterr().err


@pytest.mark.slow
def test_released_memory_lab_runs_unattempted_and_check_lists_the_exercises(tmp_path_factory, capsys):
    out, run = released_memory_run(tmp_path_factory)
    assert run.ok, f"{run.describe()}\n{run.traceback[-3000:]}"
    text = "".join(stream_text(c) for c in nbformat.read(run.output, 4).cells)
    assert "model_state_bytes: not attempted" in text and "not attempted yet: exercise measure_state_bytes" in text
    assert "+ 2 hidden tests (4 pts) when your instructor grades: they vary other parameter counts" in text
    with pytest.raises(SystemExit) as exit_:
        main(["check", str(run.output), "--tests", str(out / "notebooks" / "tests")])
    report = capsys.readouterr().out
    assert exit_.value.code == 1
    assert "TODO  model_state_bytes: not attempted" in report and "TODO  measure_state_bytes: not attempted" in report
    assert "+ 2 hidden tests (3 pts) when your instructor grades: they vary frozen layers" in report


def test_results_of_labs_run_in_the_source_folder_are_not_released(tmp_path):
    """A lab run from the course's notebooks/ writes runs/ there (gitignored); the release leaves it out, and
    keeps what the course put beside the notebooks."""
    import shutil

    source = tmp_path / "notebooks"
    source.mkdir()
    shutil.copy2(SOURCE / "00_setup.ipynb", source)
    (source / "runs" / "03_ddp" / "smoke").mkdir(parents=True)
    (source / "runs" / "03_ddp" / "smoke" / "results.jsonl").write_text("{}\n")
    (source / "data.txt").write_text("shipped with the labs")
    make_release(tmp_path / "out", source)
    assert not (tmp_path / "out" / "notebooks" / "runs").exists()
    assert (tmp_path / "out" / "notebooks" / "data.txt").read_text() == "shipped with the labs"
