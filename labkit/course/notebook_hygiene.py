"""Keep the course notebooks clean for git, as d2l's `outputcheck` does (STYLE.md #8): a committed notebook
has no outputs, no execution counts, exactly one `parameters` cell holding `PROFILE = "smoke"`, the
`labkit` kernel and its own identity; `check_hygiene` lists what keeps one from being committed, `clean`
strips what an execution wrote. Which notebooks may skip CI execution (`executes_in_ci`) is decided
here too. Running them is `labkit.course.notebooks`. Used by `labkit notebooks check|clean`,
`make clean-notebooks` and tests/test_notebooks.py. Introduced in notebook 00_setup.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from labkit.course.notebooks import ERROR_MARKER_TAG, INJECTED_TAG, KERNEL, _tags
from labkit.errors import NotebookError

#: folders whose notebooks may opt out of CI execution (they need credentials, e.g. python-chi).
EXEMPTABLE_DIRS = ("reservations",)
#: metadata written by executing or saving a notebook, never by its author.
TRANSIENT_NB_METADATA = ("papermill", "widgets")
TRANSIENT_CELL_METADATA = ("execution", "papermill", "ExecuteTime")
_PROFILE_LINE = re.compile(r"""^PROFILE\s*=\s*(["'])smoke\1\s*(#.*)?$""", re.MULTILINE)


def _read(path: str | os.PathLike):
    import nbformat

    try:
        return nbformat.read(Path(path), as_version=4)
    except FileNotFoundError:
        raise NotebookError(f"no notebook at {path}; check the path") from None
    except Exception as exc:  # noqa: BLE001 - nbformat raises several JSON / schema errors
        raise NotebookError(f"{path} is not a readable notebook ({exc}); restore it from git") from exc


def ci_exemption(nb) -> str | None:
    """The reason a notebook gives for not being executed in CI, or None if CI executes it.

    Opting out takes notebook metadata `{"labkit": {"execute_in_ci": false, "reason": "..."}}`.
    """
    meta = nb.metadata.get("labkit", {})
    if meta.get("execute_in_ci", True) is not False:
        return None
    return str(meta.get("reason", "")).strip()


def executes_in_ci(path: str | os.PathLike) -> bool:
    """False only for a notebook with a valid CI exemption: in an EXEMPTABLE_DIRS folder, with a reason."""
    path = Path(path)
    try:
        reason = ci_exemption(_read(path))
    except NotebookError:
        return True  # unreadable: executing it is where it fails, loudly
    return not (reason and path.parent.name in EXEMPTABLE_DIRS)


def _metadata_problems(path: Path, nb) -> list[str]:
    problems = []
    spec = nb.metadata.get("kernelspec", {})
    if spec.get("name") != KERNEL or spec.get("language", "python") != "python":
        problems.append(f"kernelspec is {spec.get('name')!r}; set metadata.kernelspec to "
                        f'{{"name": "{KERNEL}", "display_name": "labkit (Python 3)", "language": "python"}}')
    transient = [key for key in TRANSIENT_NB_METADATA if key in nb.metadata]
    if transient:
        problems.append(f"notebook metadata {transient} comes from an execution; run `labkit notebooks clean {path}`")
    identity = nb.metadata.get("labkit", {}).get("notebook")
    if path.parent.name == "notebooks" and identity != path.stem:
        # Grading tells a submitted notebook from another by this identity (docs/grading.md).
        problems.append(f"metadata labkit.notebook is {identity!r}; set it to {path.stem!r} (the file's stem) so "
                        "`labkit grade` can tell this notebook from the others")
    reason = ci_exemption(nb)
    if reason is not None and path.parent.name not in EXEMPTABLE_DIRS:
        problems.append(f"metadata labkit.execute_in_ci=false, but only notebooks in {'/, '.join(EXEMPTABLE_DIRS)}/ "
                        "may skip CI execution; lab notebooks must run in the smoke profile")
    elif reason == "":
        problems.append('metadata labkit.execute_in_ci=false needs a "reason" next to it saying why CI cannot run it')
    return problems


def _cell_problems(path: Path, nb) -> list[str]:
    problems = []
    first = nb.cells[0] if nb.cells else None
    if first is None or first.cell_type != "markdown" or not first.source.lstrip().startswith("#"):
        problems.append("the first cell must be a markdown title ('# NN Title')")
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    found = {
        "have outputs": [i for i, c in code if c.get("outputs")],
        "have execution counts": [i for i, c in code if c.get("execution_count") is not None],
        "have execution metadata": [i for i, c in enumerate(nb.cells)
                                    if any(key in c.metadata for key in TRANSIENT_CELL_METADATA)],
    }
    problems += [f"cells {cells} {what}; run `labkit notebooks clean {path}`" for what, cells in found.items() if cells]
    banners = [i for i, c in enumerate(nb.cells) if ERROR_MARKER_TAG in _tags(c)]
    if banners:
        problems.append(f"cells {banners} are papermill error banners; run `labkit notebooks clean {path}`")
    injected = [i for i, c in enumerate(nb.cells) if INJECTED_TAG in _tags(c)]
    if injected:
        problems.append(f"cells {injected} hold parameters papermill injected; move what you need into the "
                        "`parameters` cell and delete them")
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in _tags(c)]
    if len(tagged) != 1:
        problems.append(f"{len(tagged)} cells are tagged `parameters` {tagged}; tag exactly one code cell")
    elif nb.cells[tagged[0]].cell_type != "code" or not _PROFILE_LINE.search(nb.cells[tagged[0]].source):
        problems.append(f'the parameters cell {tagged[0]} must be a code cell with the line PROFILE = "smoke"')
    return problems


def check_hygiene(path: str | os.PathLike) -> list[str]:
    """Everything that keeps the notebook at `path` from being committed; empty when clean."""
    import nbformat

    path = Path(path)
    try:
        nb = _read(path)
    except NotebookError as exc:
        return [str(exc)]
    problems = []
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError as exc:
        problems.append(f"invalid nbformat: {exc.message}; open and save it in JupyterLab, or restore it from git")
    return problems + _metadata_problems(path, nb) + _cell_problems(path, nb)


def clean(path: str | os.PathLike) -> list[str]:
    """Strip outputs, execution counts and execution metadata in place; returns what was stripped.

    Never touches a cell's source or tags, and removes no cell an author wrote: the only cells
    removed are papermill's error banners (markdown it generates on a failed run).
    """
    import nbformat

    path = Path(path)
    nb = _read(path)
    stripped: list[str] = []
    banners = [c for c in nb.cells if ERROR_MARKER_TAG in _tags(c)]
    if banners:
        nb.cells = [c for c in nb.cells if ERROR_MARKER_TAG not in _tags(c)]
        stripped.append(f"{len(banners)} papermill error banner(s)")
    for key in TRANSIENT_NB_METADATA:
        if nb.metadata.pop(key, None) is not None:
            stripped.append(f"notebook metadata {key!r}")
    counts = {"outputs": 0, "execution counts": 0, "cell execution metadata": 0}
    for cell in nb.cells:
        if cell.cell_type == "code":
            counts["outputs"] += bool(cell.get("outputs"))
            counts["execution counts"] += cell.get("execution_count") is not None
            cell.outputs, cell.execution_count = [], None
        for key in TRANSIENT_CELL_METADATA:
            counts["cell execution metadata"] += cell.metadata.pop(key, None) is not None
    stripped += [f"{kind} of {n} cell(s)" for kind, n in counts.items() if n]
    if stripped:
        nbformat.write(nb, path)
    return stripped
