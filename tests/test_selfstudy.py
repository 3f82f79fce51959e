"""A learner's own release (`make student`, `labkit assign --self-study`): written without solutions, never
over the learner's work, with every test (hidden ones included), checked by `labkit check` in place; `labkit
solution` shows the answer key on request."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from labkit.cli import main
from labkit.course.exercises.source import exercise_cells, solution_lines
from labkit.course.selfstudy import make_self_study

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "notebooks"


def _run(capsys, *argv):
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def test_self_study_release_has_the_labs_and_every_test(tmp_path, capsys):
    code, out, _ = _run(capsys, "assign", "--self-study", "--out", str(tmp_path / "my-labs"))
    labs = tmp_path / "my-labs"
    assert code == 0 and "file(s) written, 0 already up to date, 0 of yours kept" in out
    assert {p.name for p in labs.glob("*.ipynb")} == {p.name for p in SOURCE.glob("*.ipynb")}
    assert {p.name for p in (labs / "tests").glob("*.py")} == {p.name for p in (SOURCE / "tests").glob("*.py")}
    hidden = {p.name: p.read_text() for p in (SOURCE / "tests" / "hidden").glob("*.py")}
    assert hidden and {p.name: p.read_text() for p in (labs / "tests" / "hidden").glob("*.py")} == hidden
    assert not list(labs.rglob("*.hidden.json")) and not (labs / "autograder").exists()  # the tests themselves
    src = nbformat.read(SOURCE / "03_ddp.ipynb", 4)
    mine = (labs / "03_ddp.ipynb").read_text()
    assert "BEGIN SOLUTION" not in mine and 'raise NotImplementedError(\\"exercise ring_allreduce' in mine
    secret = [line for line in solution_lines(exercise_cells(src)["ring_allreduce"]) if len(line.strip()) > 30]
    code = "\n".join(c.source for c in nbformat.read(labs / "03_ddp.ipynb", 4).cells if c.cell_type == "code")
    assert secret and not any(line.strip() in code for line in secret)  # (a markdown hint may quote one line)


def test_a_release_outside_the_course_folder_carries_what_its_labs_link_to(tmp_path):
    from labkit.course.links import notebook_links

    labs = tmp_path / "elsewhere" / "my-labs"
    rel = make_self_study(labs, SOURCE)
    targets = {(nb.name, t) for nb in labs.glob("*.ipynb") for t in notebook_links(nb)}
    assert any(t.startswith("docs/") for _, t in targets)  # 01's docs/memory.md, ...
    dead = [(nb, t) for nb, t in targets if not (labs / t).exists()]
    assert not dead and not any(t.startswith("../") for _, t in targets)
    assert "docs/memory.md" in rel.written and (labs / "docs" / "memory.md").read_text() == \
        (ROOT / "docs" / "memory.md").read_text()


def test_a_rerun_keeps_the_learners_work_and_restores_what_is_missing(tmp_path):
    labs = tmp_path / "my-labs"
    make_self_study(labs, SOURCE)
    nb = nbformat.read(labs / "03_ddp.ipynb", 4)
    nb.cells[0].source += "\nmy notes"
    nbformat.write(nb, labs / "03_ddp.ipynb")
    mine = (labs / "03_ddp.ipynb").read_bytes()
    (labs / "04_fsdp.ipynb").unlink()
    (labs / "notes.txt").write_text("mine")
    again = make_self_study(labs, SOURCE)
    assert again.kept == ("03_ddp.ipynb",) and again.written == ("04_fsdp.ipynb",)
    assert (labs / "03_ddp.ipynb").read_bytes() == mine and (labs / "notes.txt").read_text() == "mine"
    assert "04_fsdp.ipynb" in {p.name for p in labs.glob("*.ipynb")}


@pytest.mark.parametrize("where", ["notebooks", "notebooks/mine", "."])
def test_self_study_refuses_to_write_into_or_around_the_sources(tmp_path, capsys, where):
    (tmp_path / "notebooks" / "tests").mkdir(parents=True)
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# x")]),
                   str(tmp_path / "notebooks" / "01_x.ipynb"))
    code, _, err = _run(capsys, "assign", "--self-study", "--out", str(tmp_path / where),
                        "--source", str(tmp_path / "notebooks"))
    assert code == 2 and "would mix your labs with the course's source notebooks" in err


def test_solution_prints_the_reference_only_when_asked(capsys):
    code, out, _ = _run(capsys, "solution", "03_ddp", "ring_allreduce")
    src = exercise_cells(nbformat.read(SOURCE / "03_ddp.ipynb", 4))["ring_allreduce"]
    assert code == 0 and out.startswith("03_ddp / ring_allreduce: the reference solution")
    assert all(line in out for line in solution_lines(src))
    code, out, _ = _run(capsys, "solution", "03", "per_gpu")
    assert code == 0 and "per_gpu = 16 // 4  # SOLUTION" in out
    code, out, _ = _run(capsys, "solution", "03_ddp")
    assert code == 0 and "exercises: average_gradients, overlap_gradient_averaging, ring_allreduce" in out


@pytest.mark.parametrize("argv, message", [
    (("99_nope", "x"), "unknown lab '99_nope'; valid labs are: 00_setup, 01_memory, 02_single_gpu"),
    (("03_ddp", "nope"), "03_ddp has no exercise or answer 'nope'; its exercises are: average_gradients, "
                         "overlap_gradient_averaging, ring_allreduce; its answers: per_gpu"),
])
def test_solution_names_the_valid_labs_and_exercises(capsys, argv, message):
    code, out, err = _run(capsys, "solution", *argv)
    assert code == 2 and not out and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_labkit_check_works_in_my_labs(tmp_path, capsys):
    labs = tmp_path / "my-labs"
    make_self_study(labs, SOURCE)
    nb = nbformat.read(labs / "01_memory.ipynb", 4)
    answer = exercise_cells(nbformat.read(SOURCE / "01_memory.ipynb", 4))["model_state_bytes"]
    cell = next(c for c in nb.cells if c.cell_type == "code" and "def model_state_bytes" in c.source)
    cell.source = answer  # the learner's solution (here: the reference one)
    nbformat.write(nb, labs / "01_memory.ipynb")
    code, out, _ = _run(capsys, "check", str(labs / "01_memory.ipynb"))
    assert code == 1  # not executed, one exercise left
    assert "PASS  model_state_bytes" in out and "TODO  measure_state_bytes: not attempted" in out
    assert "visible + hidden checks pass" in out and "pass their visible + hidden tests" in out
    assert out.rstrip().splitlines()[-1].startswith("every check and test ran, visible + hidden")
    assert "`labkit solution 01_memory NAME`" in out
    assert "when your instructor grades" not in out and "visible tests only" not in out  # no one grades a learner


def _chunk_ring(source: str) -> str:
    """The reference ring with two classic mistakes: torch.chunk (fewer than N chunks for a short tensor) and
    group-local destinations (wrong peers in a group whose ranks are not 0..N-1). The visible test (length 17 on
    3 ranks: chunks of 6, 6, 5 either way; the whole world) cannot tell."""
    ring = source.replace("torch.tensor_split(tensor.view(-1), world)", "torch.chunk(tensor.view(-1), world)")
    ring = ring.replace("right, left = peers[(rank + 1) % world], peers[(rank - 1) % world]",
                        "right, left = (rank + 1) % world, (rank - 1) % world")
    assert ring.count("torch.chunk(") == 1 and "peers[(rank + 1)" not in ring
    return ring


@pytest.mark.slow
def test_labkit_check_in_my_labs_fails_a_chunk_based_ring_with_the_hidden_tests_message(tmp_path, capsys):
    labs = tmp_path / "my-labs"
    make_self_study(labs, SOURCE)
    nb = nbformat.read(labs / "03_ddp.ipynb", 4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "def ring_allreduce" in c.source)
    cell.source = _chunk_ring(exercise_cells(nbformat.read(SOURCE / "03_ddp.ipynb", 4))["ring_allreduce"])
    others = ("def average_gradients", "def overlap_gradient_averaging")  # cut: no process for them ("missing")
    nb.cells = [c for c in nb.cells if not any(o in c.source for o in others)]
    nbformat.write(nb, labs / "03_ddp.ipynb")
    code, out, _ = _run(capsys, "check", str(labs / "03_ddp.ipynb"))
    assert code == 1 and "FAIL  ring_allreduce: 2/3 tests pass" in out  # the visible tests pass ...
    hidden = next(line for line in out.splitlines() if "(hidden) float64_a_group_a_short_tensor" in line)
    assert "IndexError" in hidden  # ... the hidden test's message says where it broke


def test_labkit_check_in_a_class_release_ends_saying_visible_tests_only(tmp_path):
    """The report of a class release's notebook (labkit.cli.check's pure core: no exercise runs here)."""
    from labkit.cli.check import CheckReport, format_report
    from labkit.course.exercises.hidden import own_hidden_tests
    from labkit.course.exercises.hidden import HiddenInfo
    from labkit.course.exercises.release import make_release

    make_release(tmp_path, SOURCE)
    assert own_hidden_tests("03_ddp", tmp_path / "notebooks" / "tests") is None  # a release: no hidden tests
    assert own_hidden_tests("03_ddp", SOURCE / "tests") is None  # the source tree: its authors use `labkit grade`
    report = CheckReport("03_ddp", (), 1, (), (), {"ring_allreduce": HiddenInfo(1, 2.0, "short tensors"),
                                                   "average_gradients": HiddenInfo(2, 2.0)})
    last = format_report(report).splitlines()[-1]
    assert last == ("visible tests only: the graded run adds 1 hidden check(s) and 3 hidden test(s) with other "
                    "sizes and world sizes")
    assert "visible tests only" not in format_report(CheckReport("00_setup", (), 0, ()))  # nothing hidden: no line
    assert format_report(CheckReport("04_fsdp", (), 1, ())).splitlines()[-1] == \
        "visible checks only: the graded run adds 1 hidden check(s)"


def test_ex_check_in_my_labs_says_the_hidden_tests_are_the_learners(tmp_path, capsys, monkeypatch):
    from labkit.course import exercises as ex

    make_self_study(tmp_path / "my-labs", SOURCE)
    monkeypatch.chdir(tmp_path / "my-labs")  # where Jupyter runs a notebook of the copy

    def model_state_bytes(*args, **kwargs):
        raise NotImplementedError("exercise model_state_bytes")

    ex.check(model_state_bytes)
    out = capsys.readouterr().out
    assert "model_state_bytes: not attempted" in out
    assert "hidden tests (4 pts) in your copy's tests/hidden/ (`labkit check` runs them): they vary" in out
    assert "when your instructor grades" not in out
