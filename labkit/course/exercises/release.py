"""`labkit assign`: the student release of the course notebooks, and the autograder folder.

DIR/notebooks/*.ipynb: every solution region stubbed (labkit.course.exercises.source), outputs and execution
metadata cleared; DIR/notebooks/tests/*.py: the visible tests (what `ex.check` runs in the notebook), with
DIR/notebooks/tests/NN_x.hidden.json: how many hidden tests each exercise has and what they vary;
DIR/notebooks/<anything else the notebooks folder holds>; DIR/autograder/*.py: the hidden tests, with the
visible ones again in DIR/autograder/visible/ (pass DIR/autograder to `labkit grade --autograder`).
Every notebook is validated before anything is written: bad markers are one MarkerError naming the cell.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from labkit.course.exercises.hidden import write_manifest
from labkit.course.exercises.source import exercise_id, stub
from labkit.errors import GradingError

#: File written at the top of a release: `assign` only ever replaces folders of a previous release.
STAMP = ".labkit-release"
#: Not copied beside the notebooks: tests (copied below, split), editor caches, and `runs/`, where a lab run
#: from the source folder writes its results (the instructor's measurements are not the students' to start with).
_SKIP = {"tests", ".ipynb_checkpoints", "__pycache__", "runs"}


@dataclass(frozen=True)
class Release:
    notebooks: tuple[Path, ...]
    exercises: tuple[str, ...]
    visible: tuple[Path, ...]
    hidden: tuple[Path, ...]


def released_notebook(path: Path):
    """The release version of one source notebook (nbformat node)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        cell.source = stub(cell.source, exercise_id(cell), where=f"{path.name} cell {i + 1}")
        cell.outputs, cell.execution_count = [], None
        for key in ("execution", "papermill", "collapsed", "scrolled"):
            cell.metadata.pop(key, None)
    for key in ("papermill", "widgets"):
        nb.metadata.pop(key, None)
    return nb


def _prepare(out: Path, source: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for sub in (out / "notebooks", out / "autograder"):
        if sub.resolve() == source.resolve() or source.resolve() in sub.resolve().parents:
            raise GradingError(f"--out {out} would overwrite the source notebooks in {source}; choose another folder")
        if sub.exists() and any(sub.iterdir()) and not (out / STAMP).exists():
            raise GradingError(f"{sub} exists and is not a previous release (no {STAMP}); choose an empty --out")
    for sub in (out / "notebooks", out / "autograder"):
        shutil.rmtree(sub, ignore_errors=True)
    (out / STAMP).write_text("written by `labkit assign`; its notebooks/ and autograder/ are replaced on re-run\n")


def make_release(out_dir: str | Path, source_dir: str | Path = "notebooks") -> Release:
    """Write the release of `source_dir` into `out_dir` (see the module docstring)."""
    import nbformat

    source, out = Path(source_dir), Path(out_dir)
    paths = sorted(source.glob("*.ipynb"))
    if not paths:
        raise GradingError(f"no notebooks in {source}; give the course's notebooks folder with --source")
    released = {p: released_notebook(p) for p in paths}  # every marker validated before a file is written
    _prepare(out, source)
    (out / "notebooks").mkdir()
    for path, nb in released.items():
        nbformat.write(nb, out / "notebooks" / path.name)
    for item in sorted(source.iterdir()):
        if item.suffix != ".ipynb" and item.name not in _SKIP:
            copy = shutil.copytree if item.is_dir() else shutil.copy2
            copy(item, out / "notebooks" / item.name)
    visible = sorted((source / "tests").glob("*.py"))
    hidden = sorted((source / "tests" / "hidden").glob("*.py"))
    for folder, files in ((out / "notebooks" / "tests", visible), (out / "autograder", hidden),
                          (out / "autograder" / "visible", visible)):
        folder.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copy2(f, folder / f.name)
    for f in hidden:  # how many hidden tests and what they vary, never their content (`ex.check` says so)
        write_manifest(f, out / "notebooks" / "tests")
    exercises = tuple(ex for nb in released.values() for c in nb.cells if (ex := exercise_id(c)))
    return Release(tuple(out / "notebooks" / p.name for p in paths), exercises,
                   tuple(out / "notebooks" / "tests" / f.name for f in visible),
                   tuple(out / "autograder" / f.name for f in hidden))
