"""Run the course notebooks with papermill, find them, and write new ones (`build_notebook`).

Running follows d2l / nbdev_test (STYLE.md #9): run everything, keep every executed notebook (also
a failed one: papermill saves it with the traceback in place), name the failing cell, list the
failures at the end. Keeping them clean for git (d2l's `outputcheck`: no outputs, one `parameters`
cell, the `labkit` kernel) is `labkit.course.notebook_hygiene`.
Used by `labkit notebooks run`, `make smoke` and tests/test_notebooks.py. Introduced in notebook 00_setup.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from labkit.errors import ConfigError, NotebookError
from labkit.runtime.launch import environ
from labkit.profiles import get_profile

KERNEL = "labkit"
DEFAULT_TIMEOUT_S = 600.0
"""Per-cell limit: a smoke notebook runs in a minute or two, a stuck cell should not hang CI."""
#: papermill's own cells: the error banner it adds to a failed notebook, the parameters it injects.
ERROR_MARKER_TAG = "papermill-error-cell-tag"
INJECTED_TAG = "injected-parameters"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass(frozen=True)
class NotebookRun:
    """The outcome of executing one notebook."""

    name: str
    """Notebook file name without `.ipynb`, e.g. '01_memory'."""
    status: str
    """'ok', 'failed', or 'stopped': the lab needs more GPUs than the profile has and said so in its first
    cell (`labkit.runtime.hosted.require_gpus`, e.g. a 2-GPU lab on Colab's one T4) -- counted as ok."""
    seconds: float
    output: Path
    """The executed copy; written in both cases."""
    cell: int | None = None
    """0-based index of the failing cell in the SOURCE notebook (as in `nb.cells[i]`)."""
    exec_count: int | None = None
    """The failing cell's execution count, the N of 'In [N]' in the executed copy."""
    ename: str = ""
    evalue: str = ""
    traceback: str = ""
    rehearsal_log: Path | None = None
    """A rehearsal's log (`labkit.course.rehearse`): every run sized, every CUDA call recorded."""
    profile: str = ""
    cpu_seconds: float | None = None
    """CPU seconds of the kernel and every process it started (reaped children's user + system time)."""

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "stopped")

    def cells(self) -> dict[int, int]:
        """{execution count: source cell index} of the executed copy (`source_cells`)."""
        return source_cells(self.output)

    def describe(self) -> str:
        """One line naming the notebook, and for a failure the cell, the error and the executed copy."""
        kind = f"rehearsal {self.profile} " if self.rehearsal_log else ""
        if self.status == "stopped":
            return f"{self.name}: {kind}stopped in {self.seconds:.1f} s: {self.evalue}"
        if self.ok:
            cpu = f" ({self.cpu_seconds:.1f} CPU s)" if self.cpu_seconds is not None else ""
            return f"{self.name}: {kind}ok in {self.seconds:.1f} s{cpu}"
        where = "before any cell ran" if self.cell is None else f"at cell {self.cell}" + (
            f" (In [{self.exec_count}])" if self.exec_count is not None else "")
        copy = f"executed copy with the traceback: {self.output}" if self.output.exists() else "no executed copy"
        found = ""
        if self.rehearsal_log and self.ename != "RehearsalError":  # a run the node could not hold, caught by
            from labkit.course import rehearse                   # the notebook, explains a later error
            found = "".join(f"; {line}" for line in rehearse.problems(self.rehearsal_log, self.cells())[:1])
        return f"{self.name}: {kind}failed {where}: {self.ename}: {self.evalue}{found} ({copy})"


# ---------------------------------------------------------------- writing notebooks
def build_notebook(title: str, cells: Sequence[str | tuple[str, str]], *,
                   parameters: str = 'PROFILE = "smoke"', metadata: Mapping[str, Any] | None = None):
    """A notebook that passes `check_hygiene`: cell 0 the markdown `title`, cell 1 the `parameters`
    cell, then `cells` (a string is a code cell, ("markdown", text) a markdown cell).

    Write it with `nbformat.write(nb, path)`; this is how the course notebooks are generated.
    """
    import nbformat
    from nbformat import v4

    nb = v4.new_notebook(metadata={"kernelspec": {"name": KERNEL, "display_name": "labkit (Python 3)",
                                                  "language": "python"},
                                   "language_info": {"name": "python"}, **(metadata or {})})
    params = v4.new_code_cell(parameters, metadata={"tags": ["parameters"]})
    body = [v4.new_markdown_cell(c[1]) if isinstance(c, tuple) else v4.new_code_cell(c) for c in cells]
    if any(isinstance(c, tuple) and c[0] != "markdown" for c in cells):
        raise ConfigError("build_notebook cells are code strings or ('markdown', text) pairs")
    nb.cells = [v4.new_markdown_cell(title if title.startswith("#") else f"# {title}"), params, *body]
    nbformat.validate(nb)
    return nb


# ---------------------------------------------------------------- finding notebooks
def default_notebook_dir() -> Path:
    """`./notebooks` when run from a checkout, else the `notebooks/` next to the installed package."""
    here = Path.cwd() / "notebooks"
    return here if here.is_dir() else Path(__file__).resolve().parents[2] / "notebooks"


def find_notebooks(names: Sequence[str] | None = None, notebook_dir: str | os.PathLike | None = None) -> list[Path]:
    """Notebook paths for `names` ('01_memory', '01_memory.ipynb', '01' or a path); all when None."""
    folder = Path(notebook_dir) if notebook_dir is not None else default_notebook_dir()
    available = sorted(folder.glob("*.ipynb"))
    if not names:
        if not available:
            raise NotebookError(f"no notebooks in {folder}; run from the repository root or pass paths")
        return available
    found: list[Path] = []
    for name in names:
        path = Path(name)
        if path.suffix == ".ipynb" and path.is_file():
            match = [path]
        else:
            stem = path.name.removesuffix(".ipynb")
            match = [p for p in available if p.stem == stem] or [p for p in available if p.stem.startswith(stem + "_")]
        if len(match) != 1:
            listed = ", ".join(p.stem for p in available) or "(none)"
            kind = "ambiguous" if match else "unknown"
            raise NotebookError(f"{kind} notebook {name!r}; notebooks in {folder}: {listed}")
        if match[0] not in found:
            found.append(match[0])
    return found


# ---------------------------------------------------------------- running
def _tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def _failing_cell(output: Path, exec_index: int | None) -> tuple[int | None, int | None]:
    """(source cell index, execution count) of the failing cell of an executed copy.

    `exec_index` indexes the executed notebook without papermill's error banners; when it is None
    (a timeout or a dead kernel) the failing cell is the last one papermill started. The executed
    copy has one extra cell, papermill's injected parameters; subtracting it gives the source index.
    """
    import nbformat

    try:
        nb = nbformat.read(output, as_version=4)
    except (OSError, ValueError):
        return None, None
    cells = [c for c in nb.cells if ERROR_MARKER_TAG not in _tags(c)]
    if exec_index is None:
        started = [i for i, c in enumerate(cells) if c.get("metadata", {}).get("papermill", {}).get("start_time")]
        if not started:
            return None, None
        exec_index = started[-1]
    injected_before = sum(INJECTED_TAG in _tags(c) for c in cells[:exec_index])
    source_index = exec_index - injected_before
    if INJECTED_TAG in _tags(cells[exec_index]):
        source_index -= 1  # a bad injected parameter is reported at the `parameters` cell above it
    return max(source_index, 0), cells[exec_index].get("execution_count")


def source_cells(executed: str | os.PathLike) -> dict[int, int]:
    """{execution count: source cell index} of an executed copy (papermill's injected cell skipped)."""
    import nbformat

    if not Path(executed).is_file():
        return {}
    nb = nbformat.read(executed, as_version=4)
    out, injected = {}, 0
    for i, cell in enumerate(nb.cells):
        if INJECTED_TAG in _tags(cell):
            injected += 1
        elif cell.cell_type == "code" and cell.get("execution_count") is not None:
            out[cell["execution_count"]] = i - injected
    return out


def run_notebook(path: str | os.PathLike, *, profile: str = "smoke", out_dir: str | os.PathLike = "build/executed",
                 timeout_s: float = DEFAULT_TIMEOUT_S, kernel: str = KERNEL,
                 parameters: Mapping[str, Any] | None = None, rehearse: bool = False) -> NotebookRun:
    """Execute one notebook with papermill in its own folder, keeping the executed copy in `out_dir`.

    `rehearse`: the profile's notebook on this machine's CPU (`labkit.runtime.rehearsal`, docs/gpu-node.md);
    the log of its runs and CUDA calls goes beside the executed copy (`<name>.rehearsal.jsonl`)."""
    import papermill
    from papermill.exceptions import PapermillExecutionError

    src = Path(path).resolve()
    get_profile(profile)  # an unknown profile fails here, listing the valid ones
    params = {"PROFILE": profile, **(parameters or {})}
    if params["PROFILE"] != profile:
        raise ConfigError(f"parameters PROFILE={params['PROFILE']!r} contradicts profile={profile!r}; "
                          "choose the profile with `profile` only")
    out = Path(out_dir).resolve() / src.name
    if out == src:
        raise ConfigError(f"the executed copy of {src.name} would replace the notebook itself in {src.parent}: "
                          "choose another output folder (--out build/executed)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)  # a copy left by an earlier run must not pass for this run's
    fail: dict[str, Any] = {}
    env = {"MPLBACKEND": "Agg"}  # no GUI windows from matplotlib in a headless kernel
    log = None
    if rehearse:
        from labkit.course import rehearse as rehearsal_log
        log = out.with_suffix(".rehearsal.jsonl")
        env.update(rehearsal_log.environment(log, profile))
    start, cpu_start = time.perf_counter(), _children_cpu()
    try:
        with environ(**env):
            papermill.execute_notebook(str(src), str(out), parameters=params, kernel_name=kernel,
                                       cwd=str(src.parent), progress_bar=False,
                                       execution_timeout=timeout_s,
                                       kernel_manager_class=_kernel_manager())
    except PapermillExecutionError as exc:
        fail = dict(index=exc.cell_index, ename=exc.ename, evalue=exc.evalue, tb="\n".join(exc.traceback))
    except Exception as exc:  # noqa: BLE001 - timeouts, dead kernels, unknown kernels: still a failed run
        fail = dict(index=None, ename=type(exc).__name__, evalue=str(exc).strip().splitlines()[0] if str(exc) else "",
                    tb=str(exc))
    seconds = time.perf_counter() - start
    common = dict(rehearsal_log=log, profile=profile, cpu_seconds=_children_cpu() - cpu_start)
    if not fail and log is not None:  # the notebook handled an OOM the node would hit on a run that must fit
        from labkit.course import rehearse as rehearsal_log
        cells = source_cells(out)
        found = rehearsal_log.problems(log, cells)
        if found:
            return NotebookRun(src.stem, "failed", seconds, out, cell=rehearsal_log.problem_cell(log, cells),
                               ename="RehearsalError", evalue=found[0], **common)
    if not fail:
        return NotebookRun(src.stem, "ok", seconds, out, **common)
    if fail["ename"] == "NeedsMoreGPUs":  # labkit.runtime.hosted.require_gpus: where to run the lab instead, not a failure
        return NotebookRun(src.stem, "stopped", seconds, out, ename=fail["ename"], evalue=_ANSI.sub("", fail["evalue"]),
                           **common)
    cell, count = _failing_cell(out, fail["index"]) if out.exists() else (None, None)
    return NotebookRun(src.stem, "failed", seconds, out, cell=cell, exec_count=count, ename=fail["ename"],
                       evalue=_ANSI.sub("", fail["evalue"]), traceback=_ANSI.sub("", fail["tb"]), **common)


def _kernel_manager():
    """labkit's kernel manager (labkit.course.kernel_client), or the test suite's (labkit.runtime.hooks)."""
    from labkit.course.kernel_client import KernelManager
    from labkit.runtime import hooks

    hook = hooks.get("kernel_manager_class")
    return (hook() if hook else None) or KernelManager


def _children_cpu() -> float:
    """User + system CPU seconds of this process's reaped children (a kernel, and what it reaped), and of
    the kernels a test hook reaped elsewhere (labkit.runtime.hooks: not this process's children)."""
    import resource

    from labkit.runtime import hooks

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    reaped = hooks.get("reaped_cpu")
    return usage.ru_utime + usage.ru_stime + (reaped() if reaped else 0.0)


def run_notebooks(names: Sequence[str] | None = None, *, profile: str = "smoke",
                  out_dir: str | os.PathLike = "build/executed", timeout_s: float = DEFAULT_TIMEOUT_S,
                  kernel: str = KERNEL, parameters: Mapping[str, Any] | None = None,
                  notebook_dir: str | os.PathLike | None = None,
                  progress: Callable[[str], None] | None = None, rehearse: bool = False) -> list[NotebookRun]:
    """Run every named notebook (all of `notebooks/` by default), never stopping at a failure."""
    paths = find_notebooks(names, notebook_dir)
    get_profile(profile)  # fail before the first kernel starts
    runs = []
    for path in paths:
        if progress:
            progress(f"running {path.stem} (profile {profile}) ...")
        runs.append(run_notebook(path, profile=profile, out_dir=out_dir, timeout_s=timeout_s,
                                 kernel=kernel, parameters=parameters, rehearse=rehearse))
        if progress:
            progress(runs[-1].describe())
    return runs


def format_runs(runs: Sequence[NotebookRun]) -> str:
    """Fixed-width table: notebook, status, wall and CPU seconds, failing cell and error."""
    rows = [("notebook", "status", "seconds", "cpu s", "failure")]
    for r in runs:
        failure = r.evalue[:100] if r.status == "stopped" else "" if r.ok else f"cell {r.cell}: {r.ename}: {r.evalue}"[:100]
        cpu = "" if r.cpu_seconds is None else f"{r.cpu_seconds:.1f}"
        rows.append((r.name, r.status, f"{r.seconds:.1f}", cpu, failure))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(f"{a.ljust(widths[0])}  {b.ljust(widths[1])}  {c.rjust(widths[2])}  {d.rjust(widths[3])}  {e}"
                     .rstrip() for a, b, c, d, e in rows)
