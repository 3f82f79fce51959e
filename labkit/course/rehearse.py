"""The course side of a rehearsal (`labkit.runtime.rehearsal`): run a GPU profile's notebooks on any machine the
week before class, read what they did, and keep the manifest of every lab run per profile.

`labkit notebooks run --profile a100x4 --rehearse` (`make rehearse PROFILE=a100x4`) executes each notebook
with `environment(log)` set: the kernel and every rank it starts append to `<name>.rehearsal.jsonl`
beside the executed copy -- one line per run (sized at its real size, `event: run`), per shown record
(`event: key`) and per CUDA call the node would have made (`set_device`, `init_process_group`, `mesh`,
...; `labkit.runtime.device`). `observed_runs` turns a log into the notebook's runs with their cell; `problems`
names the runs the node could not hold; `MANIFEST` (labkit/data/lab_runs.json) keeps, per profile, the
runs every notebook makes, which `labkit.course.profile_check.lab_runs` -- and through it the preflight
-- reads: nobody keeps that list by hand, and tests/test_rehearsal.py checks it against what the
rehearsal observes. Adding a profile: rehearse it with `--write-manifest`. docs/gpu-node.md says more.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.errors import ConfigError

#: Every profile's lab runs, as observed by rehearsing its notebooks (`write_manifest`).
MANIFEST = Path(__file__).resolve().parents[1] / "data" / "lab_runs.json"
#: Run sources that are labkit training runs (the preflight trains them); `library_parts` feeds a
#: student's own loop under `ex.spawn` and is sized, but is not a run of a strategy.
RUN_SOURCES = ("run",)


def environment(log: str | os.PathLike, profile: str | None = None) -> dict[str, str]:
    """The environment of a rehearsing kernel (and of every rank it starts) logging to `log` (emptied);
    `profile`: the notebook's PROFILE, which every run it makes must train on."""
    from labkit.runtime import rehearsal

    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("", encoding="utf-8")
    # DeepSpeed picks its accelerator at import: the CPU's, as on a CPU profile.
    return {rehearsal.REHEARSE_ENV: "1", rehearsal.LOG_ENV: str(log.resolve()), "DS_ACCELERATOR": "cpu",
            **({rehearsal.PROFILE_ENV: profile} if profile else {})}


def read(log: str | os.PathLike) -> list[dict[str, Any]]:
    """Every entry of a rehearsal log, in order."""
    path = Path(log)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@dataclass(frozen=True)
class ObservedRun:
    """One run a notebook made in a rehearsal, sized at its real size."""

    notebook: str
    cell: int | None
    """Source cell index (as in `nb.cells[i]`), None when the log has no execution count for it."""
    label: str
    """The key the notebook showed its record under (`labkit.results.show`), else the strategy."""
    strategy: str
    model: str
    options: dict = field(default_factory=dict)
    bytes: int | None = None
    capacity: float | None = None
    fits: bool = True
    gpus_ok: bool = True
    may_oom: bool = False
    """Inside `labkit.runtime.rehearsal.may_oom()`: a lesson's deliberate out-of-memory run."""
    describe: str = ""
    fix: str = ""
    profile: str = ""
    """The profile the run trained on: the notebook's, or a CPU profile a lesson names on purpose (09's
    multi-rank runs on smoke's CPU ranks on a one-GPU node)."""

    def row(self) -> dict[str, Any]:
        """What the manifest keeps: lab, label, strategy, model, options (and may_oom when set, the profile
        when the run is on a CPU profile: not a run of the node's GPUs)."""
        row = {"lab": self.notebook, "label": self.label, "strategy": self.strategy, "model": self.model,
               "options": self.options}
        return {**row, **({"may_oom": True} if self.may_oom else {}),
                **({"profile": self.profile} if on_cpu(self.profile) else {})}


def on_cpu(profile: str) -> bool:
    """True for a CPU profile's name ('' -- not recorded -- is not)."""
    from labkit.profiles import get_profile

    return bool(profile) and get_profile(profile).device != "cuda"


def observed_runs(log: str | os.PathLike, cells: dict[int, int] | None = None, *,
                  sources: tuple[str, ...] = RUN_SOURCES) -> list[ObservedRun]:
    """The runs of a rehearsal log, each with its cell (a run made on every rank of a spawn: rank 0's).
    `cells` maps execution counts to source cells (`labkit.course.notebooks.source_cells`)."""
    entries = read(log)
    notebook = Path(log).name.split(".")[0]
    cells = cells or {}
    keys = {e["run_id"]: e["key"] for e in entries if e["event"] == "key"}
    runs = []
    for e in entries:
        if e["event"] != "run" or e.get("via") not in sources or e.get("rank", 0) != 0:
            continue
        runs.append(ObservedRun(notebook, cells.get(e.get("exec_count")), keys.get(e["run_id"], e["strategy"]),
                                e["strategy"], e["model"], e["options"], e.get("bytes"), e.get("capacity"),
                                e.get("fits", True), e.get("gpus_ok", True), e.get("may_oom", False),
                                e.get("describe", ""), e.get("fix", ""), e.get("profile", "")))
    return runs


def problems(log: str | os.PathLike, cells: dict[int, int] | None = None) -> list[str]:
    """One line per run the node could not hold (too many GPUs, or over the memory headroom and not a
    lesson's deliberate `may_oom()` run), naming its cell, the run and the fix."""
    out = []
    for r in observed_runs(log, cells, sources=("run", "library_parts")):
        where = f"cell {r.cell}" if r.cell is not None else "a cell"
        if not r.gpus_ok:
            out.append(f"{where}: run {r.describe} asks for more GPUs than the node has; fix: nproc=profile.nproc")
        elif not r.fits and not r.may_oom:
            out.append(f"{where}: run {r.describe} needs ~{r.bytes / 1e9:.1f} GB per GPU > {r.capacity / 1e9:.1f} GB "
                       f"(out of memory on the node); fix: {r.fix}")
    return out


def problem_cell(log: str | os.PathLike, cells: dict[int, int] | None = None) -> int | None:
    """The cell of the first problem `problems` names."""
    for r in observed_runs(log, cells, sources=("run", "library_parts")):
        if not r.gpus_ok or (not r.fits and not r.may_oom):
            return r.cell
    return None


def calls(log: str | os.PathLike, event: str | None = None) -> list[dict[str, Any]]:
    """The CUDA calls the node would have made (`labkit.runtime.device.record`), of one `event` or all."""
    return [e for e in read(log) if e["event"] not in ("run", "key") and (event is None or e["event"] == event)]


# ------------------------------------------------------------------------------------ the manifest
def load_manifest(path: str | os.PathLike = MANIFEST) -> dict[str, list[dict[str, Any]]]:
    """{profile: [manifest rows]} (empty when the file does not exist yet)."""
    path = Path(path)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def manifest_rows(profile: str, path: str | os.PathLike = MANIFEST) -> list[dict[str, Any]]:
    """The manifest's runs of `profile`; ConfigError naming the command that makes them when absent."""
    found = load_manifest(path).get(profile)
    if found is None:
        raise ConfigError(f"no lab runs of profile {profile!r} in {path}: rehearse its notebooks once with "
                          f"`labkit notebooks run --profile {profile} --rehearse --write-manifest` (docs/gpu-node.md)")
    return found


def write_manifest(profile: str, runs: list[ObservedRun], path: str | os.PathLike = MANIFEST) -> Path:
    """Replace `profile`'s rows of the manifest with `runs` (in notebook order); other profiles stay."""
    path = Path(path)
    data = load_manifest(path)
    data[profile] = [r.row() for r in runs]
    path.write_text(json.dumps(dict(sorted(data.items())), indent=1, sort_keys=False) + "\n", encoding="utf-8")
    return path


def runs_of(results: list) -> list[ObservedRun]:
    """Every run of a list of rehearsed `labkit.course.notebooks.NotebookRun`s, in notebook order."""
    out: list[ObservedRun] = []
    for run in results:
        if run.rehearsal_log is not None:
            out += observed_runs(run.rehearsal_log, run.cells())
    return out
