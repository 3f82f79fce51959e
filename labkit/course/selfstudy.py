"""A self-study learner's own release (`make student`, `labkit assign --self-study`) and the answer key on
request (`labkit solution LAB NAME`).

A learner works in `my-labs/` (the student release of `labkit assign`: every solution stubbed, the visible
tests beside the notebooks in `my-labs/tests/` and the hidden ones in `my-labs/tests/hidden/`: no one grades a
self-study learner, so nothing is kept from them, and `labkit check` there runs every test with its message)
and keeps the course's source notebooks as the answer key, read only when asked (`labkit solution`). Writing the release never replaces a file that is already
there: a re-run adds what is missing and names every file it kept, so a learner's work is never lost.
"""
from __future__ import annotations

import filecmp
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from labkit.course.exercises.hidden import MANIFEST_SUFFIX
from labkit.course.exercises.release import make_release
from labkit.course.exercises.source import ONE_LINE_ANSWER, exercise_id
from labkit.errors import ConfigError, GradingError, choices_error

#: Where `make student` and `labkit assign --self-study` write unless told otherwise.
DEFAULT_OUT = "my-labs"
#: The hidden tests' folder inside a copy's tests/ (the source tree's layout: notebooks/tests/hidden).
HIDDEN_DIR = "hidden"


def course_notebooks() -> Path:
    """The source tree's notebooks/ (the answer key) beside the labkit package that is imported."""
    from labkit.course import source_tree

    return source_tree() / "notebooks"


@dataclass(frozen=True)
class SelfStudyRelease:
    out: Path
    written: tuple[str, ...]
    """Files added (paths relative to `out`)."""
    kept: tuple[str, ...]
    """Files already there that differ from the fresh release: the learner's, left as they are."""
    unchanged: tuple[str, ...]
    """Files already there, identical to the fresh release."""
    exercises: int


def make_self_study(out_dir: str | Path = DEFAULT_OUT, source_dir: str | Path | None = None) -> SelfStudyRelease:
    """Write the student release of `source_dir` into `out_dir` without replacing anything already there."""
    source = Path(source_dir) if source_dir is not None else course_notebooks()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise GradingError(f"{out} is a file, not a folder; choose another --out")
    resolved = out.resolve()
    if resolved == source.resolve() or source.resolve() in resolved.parents or resolved in source.resolve().parents:
        raise GradingError(f"--out {out} would mix your labs with the course's source notebooks in {source}; "
                           f"choose a folder outside it, e.g. {DEFAULT_OUT}")
    with tempfile.TemporaryDirectory(prefix="labkit-release-") as tmp:
        release = make_release(tmp, source)  # validates every notebook before anything is written
        fresh = Path(tmp) / "notebooks"
        _carry_hidden(release, fresh / "tests" / HIDDEN_DIR)
        if resolved.parent != source.resolve().parent:  # not beside the course's docs/: carry what the labs link to
            _carry_links(source, fresh)
        written, kept, unchanged = [], [], []
        for path in sorted(p for p in fresh.rglob("*") if p.is_file() and not p.name.endswith(MANIFEST_SUFFIX)):
            rel = path.relative_to(fresh)
            target = out / rel
            if target.exists():
                (unchanged if target.is_file() and filecmp.cmp(path, target, shallow=False) else kept).append(str(rel))
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            written.append(str(rel))
    return SelfStudyRelease(out, tuple(written), tuple(kept), tuple(unchanged), len(release.exercises))


def _carry_hidden(release, folder: Path) -> None:
    """The hidden tests into the learner's copy (tests/hidden/, as in the course's source tree): their own answer
    key, which `labkit check` runs beside the visible tests (labkit.cli.check)."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in release.hidden:
        shutil.copy2(path, folder / path.name)


def _carry_links(source: Path, fresh: Path) -> None:
    """A release outside the course folder: the labs' `../docs/x.md` links would be dead there. Put every course
    file the labs link to into the release (`docs/x.md`) and make the notebooks' links point one level down."""
    import nbformat

    from labkit.course.links import copy_linked

    copy_linked(source, fresh)  # at the same place relative to the labs' folder as in the course: docs/x.md
    down = (("](../", "]("), ("](<../", "](<"), ('href="../', 'href="'), ('src="../', 'src="'))
    for path in fresh.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        before = [cell.source for cell in nb.cells]
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                for old, new in down:
                    cell.source = cell.source.replace(old, new)
        if [cell.source for cell in nb.cells] != before:
            nbformat.write(nb, path)


def format_self_study(rel: SelfStudyRelease) -> str:
    lines = [f"{rel.out}: {len(rel.written)} file(s) written, {len(rel.unchanged)} already up to date, "
             f"{len(rel.kept)} of yours kept ({rel.exercises} code exercises in the labs)"]
    for name in rel.kept:
        lines.append(f"  kept your {name} (it differs from the course's copy; to get a fresh one, rename yours "
                     f"and run this again)")
    lines.append(f"next: open {rel.out}/ in Jupyter (jupyter lab --notebook-dir={rel.out}), run a lab, save it, then "
                 f"`labkit check {rel.out}/01_memory.ipynb` (every test, hidden ones included: yours to see); "
                 "a reference solution: "
                 "`labkit solution 03_ddp ring_allreduce`")
    return "\n".join(lines)


# ---- the answer key ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Solution:
    lab: str
    name: str
    kind: str
    """'exercise' (a function the learner writes) or 'answer' (a one-line `name = ...  # SOLUTION`)."""
    cell: int
    """1-based cell number in the source notebook, markdown included."""
    source: str


def _labs(source: Path) -> dict[str, Path]:
    return {p.stem: p for p in sorted(source.glob("*.ipynb"))}


def _answer_name(line: str) -> str | None:
    match = ONE_LINE_ANSWER.match(line)
    return match.group(2) if match else None


def solutions(lab: str, source_dir: str | Path | None = None) -> dict[str, Solution]:
    """{name: Solution} of one source notebook: its code exercises, then its one-line answers."""
    import nbformat

    source = Path(source_dir) if source_dir is not None else course_notebooks()
    labs = _labs(source)
    if not labs:
        raise GradingError(f"no course notebooks in {source}: `labkit solution` reads the course's source tree "
                           "(a clone of the repository); pass --source NOTEBOOKS_DIR")
    path = labs.get(lab) or next((p for stem, p in labs.items() if stem.split("_", 1)[0] == lab), None)
    if path is None:
        raise choices_error("lab", lab, labs)
    nb = nbformat.read(path, as_version=4)
    found: dict[str, Solution] = {}
    for i, cell in enumerate(nb.cells, start=1):
        ex_id = exercise_id(cell)
        if ex_id and ex_id not in found:
            found[ex_id] = Solution(path.stem, ex_id, "exercise", i, cell.source)
    for i, cell in enumerate(nb.cells, start=1):
        if cell.cell_type != "code":
            continue
        for line in cell.source.splitlines():
            name = _answer_name(line)
            if name and name not in found:
                found[name] = Solution(path.stem, name, "answer", i, line.strip())
    return found


def solution(lab: str, name: str, source_dir: str | Path | None = None) -> Solution:
    """The reference solution of exercise (or one-line answer) `name` of `lab`; ConfigError lists the valid ones."""
    found = solutions(lab, source_dir)
    if name not in found:
        kinds = {k: ", ".join(s.name for s in found.values() if s.kind == k) or "(none)" for k in ("exercise", "answer")}
        stem = next(iter(found.values())).lab if found else lab
        raise ConfigError(f"{stem} has no exercise or answer {name!r}; its exercises are: {kinds['exercise']}; "
                          f"its answers: {kinds['answer']}")
    return found[name]


def format_solution(sol: Solution) -> str:
    head = (f"{sol.lab} / {sol.name}: the reference solution (source notebook cell {sol.cell}; "
            + ("you write the lines between the markers)" if sol.kind == "exercise" else "a one-line answer)"))
    return f"{head}\n\n{sol.source.rstrip()}\n"
