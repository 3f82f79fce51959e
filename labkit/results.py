"""One schema for every measured run, on disk (JSONL) and inside executed notebooks.

Every strategy's run produces one `RunRecord`; rank 0 appends it to `<out>/results.jsonl`. Beside the
numbers every run has, a record carries typed facts (`labkit.facts`): `record.train` always, and the
groups its strategy records (`record.comm`, `record.sharding`, `record.pipeline`, `record.peft`, ...,
None when not recorded). Records of schema 1 (a flat `extra` dict) still load: their keys are mapped
onto the groups; a record from a newer labkit is a one-line error naming the file. Where records go:
`run_dir(lab, profile)` under `runs_root()` (`$LABKIT_RUNS`, else `runs` beside the notebook).

Notebooks call `show(record)` / `answer(key, value)`, which put the data into the cell output under
the MIME type `application/vnd.labkit+json`, so grading reads data, never printed text. The payload
passes through the publishers registered with `register_publisher(name, fn)` first: the course layer
seals it (`labkit.course.grading.fingerprint.seal`). This module never imports the course layer: the package
root (`labkit/__init__.py`) registers the seal, importing `labkit.course.grading` only when a notebook first
publishes, and `import labkit.course.grading` registers it too; so a notebook needs no extra line.
Introduced in notebook 02_single_gpu.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from labkit import facts as F
from labkit.errors import ConfigError
from labkit.runtime.rehearsal import expect  # noqa: F401 - notebooks assert on measured values with R.expect

MIME = "application/vnd.labkit+json"
SCHEMA_VERSION = 2
"""2: typed facts groups (`labkit.facts`); 1: a flat `extra` dict (still loads)."""


@dataclass(frozen=True)
class RunRecord:
    """One measured training run. Per-rank lists have one entry per rank, rank order."""

    strategy: str
    model: str
    profile: str
    world_size: int
    steps: int
    losses: list[float]
    """Per-step training loss, averaged over ranks."""
    step_time_s: float
    """Median optimizer-step wall time, warm-up steps excluded."""
    samples_per_s: float
    peak_bytes: list[int]
    """Peak bytes allocated per rank (CUDA allocator on GPU, tensor accounting on CPU)."""
    param_bytes: list[int]
    grad_bytes: list[int]
    optimizer_bytes: list[int]
    trainable_params: int
    device: str
    dtype: str
    global_batch: int = 0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    cpu_offload_bytes: list[int] = field(default_factory=list)
    """Bytes a strategy moved to host memory per rank (offload), 0 where nothing was offloaded."""
    train: F.TrainFacts = field(default_factory=F.TrainFacts)
    comm: F.CommFacts | None = None
    """Bytes per rank per step by collective; None where the strategy does not model its traffic."""
    optim: F.OptimizerFacts | None = None
    sharding: F.ShardingFacts | None = None
    memory: F.MemoryFacts | None = None
    pipeline: F.PipelineFacts | None = None
    tensor: F.TensorFacts | None = None
    context: F.ContextFacts | None = None
    expert: F.ExpertFacts | None = None
    peft: F.PeftFacts | None = None
    accelerate: F.AccelerateFacts | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    """Free-form notes nothing reads by name (and schema-1 `extra` keys no facts group knows)."""
    rehearsal: bool = False
    """True for a rehearsal's stand-in run (`labkit.runtime.rehearsal`): not a measurement, never graded."""
    versions: dict[str, str] = field(default_factory=dict)
    timestamp: str = ""
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        for name in ("peak_bytes", "param_bytes", "grad_bytes", "optimizer_bytes"):
            values = getattr(self, name)
            if len(values) != self.world_size:
                raise ConfigError(f"RunRecord.{name} has {len(values)} entries for world_size="
                                  f"{self.world_size}; give one value per rank")
        for group, facts_cls in F.GROUPS.items():  # JSON data (from_dict, a test) becomes the typed facts
            value = getattr(self, group)
            if isinstance(value, dict):
                object.__setattr__(self, group, F.build(facts_cls, value))
            elif value is not None and not isinstance(value, facts_cls):
                raise ConfigError(f"RunRecord.{group} is a {type(value).__name__}; give a "
                                  f"labkit.facts.{facts_cls.__name__}")
        if not self.timestamp:
            object.__setattr__(self, "timestamp", _dt.datetime.now(_dt.timezone.utc).isoformat())
        if not self.versions:
            object.__setattr__(self, "versions", versions())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunRecord":
        """A record from its `to_dict()` data, schema 1 (flat `extra`, the default when absent) or 2."""
        data = dict(data)
        schema = data.get("schema", 1)
        if not isinstance(schema, int) or schema > SCHEMA_VERSION:
            raise ConfigError(f"RunRecord schema {schema!r} is newer than this labkit's ({SCHEMA_VERSION}); "
                              "upgrade labkit (pip install -U labkit) to read it")
        if schema == 1:
            groups, notes = F.from_legacy(data.pop("extra", None) or {})
            data.update(groups, notes={**notes, **data.get("notes", {})}, schema=SCHEMA_VERSION)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown RunRecord fields {unknown}; is the file from a newer labkit?")
        return cls(**data)


def versions() -> dict[str, str]:
    """Versions of the stack that shape a measurement (imported lazily, missing ones skipped)."""
    out = {"python": platform.python_version()}
    from importlib import metadata
    for dist in ("torch", "deepspeed", "transformers", "peft", "bitsandbytes", "accelerate", "labkit"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


#: The one root every lab's results go under (`run_dir`), `labkit train`'s default --out and the place
#: `labkit bench comm` keeps the node's measured bandwidth. Unset: `runs`, relative to the working
#: directory -- beside the notebook, since a kernel runs in its notebook's folder. Containers set it to
#: their mounted, writable folder (containers/README.md), where a read-only image cannot lose results.
RUNS_ENV = "LABKIT_RUNS"


def runs_root() -> str:
    """$LABKIT_RUNS (user folder expanded), else 'runs'."""
    return os.path.expanduser(os.environ.get(RUNS_ENV) or "runs")


def run_dir(*parts: str) -> str:
    """`runs_root()/parts...`, created now: a lab's setup cell (`OUT = R.run_dir("03_ddp", PROFILE)`)
    fails at once, naming the fix, where results could not be written -- not after the first run."""
    path = Path(runs_root(), *map(str, parts))
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".labkit-write-test"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write results to {path.resolve()} ({exc.strerror or exc}); set {RUNS_ENV} to a "
                          f"writable folder that outlives this machine's session, e.g. export {RUNS_ENV}=$HOME/labkit-runs "
                          "(containers/README.md)") from None
    return str(path)


def append(record: RunRecord, out_dir: str | os.PathLike) -> Path:
    """Append `record` as one JSON line to `out_dir/results.jsonl` (call on rank 0 only)."""
    path = Path(out_dir) / "results.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(record.to_dict(), sort_keys=True) + "\n")
    return path


def load(path: str | os.PathLike) -> list[RunRecord]:
    """All records of a results.jsonl file (or of `<dir>/results.jsonl`)."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.jsonl"
    if not path.exists():
        raise ConfigError(f"no results at {path}; run `labkit train ... --out {path.parent}` first")
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                records.append(RunRecord.from_dict(json.loads(line)))
            except (json.JSONDecodeError, TypeError) as exc:
                raise ConfigError(f"{path}:{lineno} is not a RunRecord ({exc}); remove or fix that line") from exc
            except ConfigError as exc:
                raise ConfigError(f"{path}:{lineno}: {exc}") from exc
    return records


def latest(path: str | os.PathLike, **match: Any) -> RunRecord:
    """The newest record in `path` whose fields equal `match` (e.g. strategy='ddp')."""
    found = [r for r in load(path) if all(getattr(r, k) == v for k, v in match.items())]
    if not found:
        raise ConfigError(f"no record in {path} matches {match}")
    return found[-1]


# ---------------------------------------------------------------- notebooks
#: name -> fn(payload, text) -> payload, applied in registration order before a payload is displayed.
_PUBLISHERS: dict[str, Callable[[dict[str, Any], str], dict[str, Any]]] = {}


def register_publisher(name: str, fn: Callable[[dict[str, Any], str], dict[str, Any]]) -> None:
    """Pass every payload `show` / `answer` publish through `fn(payload, text)`, which returns the payload
    to display (the course layer adds its seal). Registering a name again replaces that publisher."""
    _PUBLISHERS[name] = fn


def _publish(payload: dict[str, Any], text: str) -> None:
    """Display `payload` (after the registered publishers, e.g. the grading seal) and `text`."""
    from IPython.display import display

    for fn in list(_PUBLISHERS.values()):
        payload = fn(payload, text)
    display({MIME: payload, "text/plain": text}, raw=True)


def show(record: RunRecord, *, key: str | None = None) -> RunRecord:
    """Display `record` in a notebook: a short text line plus the full record as data for grading
    (a rehearsal's record says so on its line)."""
    from labkit.runtime import rehearsal

    payload = {"kind": "run", "key": key or record.strategy, "record": record.to_dict()}
    rehearsal.note_key(record.train.run_id, key or record.strategy)
    text = summary_line(record)
    _publish(payload, f"[rehearsal, not a measurement] {text}" if record.rehearsal else text)
    return record


def answer(key: str, value: Any) -> Any:
    """Record an exercise answer under `key` in the executed notebook (read by `labkit check`)."""
    json.dumps(value)  # fail here, in the student's cell, if the answer is not JSON data
    _publish({"kind": "answer", "key": key, "value": value}, f"answer {key} = {value!r}")
    return value


def from_notebook(nb) -> list[dict[str, Any]]:
    """Every labkit payload in an executed notebook (nbformat node), in cell order, with cell index.

    Payloads keep their `fingerprint` (the seal `labkit.course.grading.tamper` verifies), if one was added."""
    found = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            data = output.get("data", {})
            if MIME in data:
                found.append({"cell": index, **data[MIME]})
    return found


# ---------------------------------------------------------------- comparison
def _gib(values: Sequence[int]) -> float:
    return max(values, default=0) / 2**30


def summary_line(r: RunRecord) -> str:
    first, last = (r.losses[0], r.losses[-1]) if r.losses else (float("nan"), float("nan"))
    return (f"{r.strategy:>14} {r.model} x{r.world_size}: loss {first:.4f} -> {last:.4f}, "
            f"{r.step_time_s * 1e3:.1f} ms/step, {r.samples_per_s:.1f} samples/s, "
            f"peak {_gib(r.peak_bytes):.3f} GiB/rank")


COLUMNS = ("strategy", "model", "world_size", "final_loss", "step_ms", "samples_per_s",
           "peak_MiB", "param_MiB", "grad_MiB", "optim_MiB")


def table(records: Iterable[RunRecord]) -> list[dict[str, Any]]:
    """One row per record; memory columns are the max over ranks in MiB (2^20 bytes)."""
    rows = []
    for r in records:
        mib = lambda xs: round(max(xs, default=0) / 2**20, 3)  # noqa: E731
        rows.append(dict(strategy=r.strategy, model=r.model, world_size=r.world_size,
                         final_loss=round(r.losses[-1], 5) if r.losses else None,
                         step_ms=round(r.step_time_s * 1e3, 2), samples_per_s=round(r.samples_per_s, 2),
                         peak_MiB=mib(r.peak_bytes), param_MiB=mib(r.param_bytes),
                         grad_MiB=mib(r.grad_bytes), optim_MiB=mib(r.optimizer_bytes)))
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Fixed-width text for `table()` rows."""
    if not rows:
        return "(no runs)"
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(str(row[c])) for row in rows)) for c in cols}
    lines = ["  ".join(c.rjust(widths[c]) for c in cols)]
    lines += ["  ".join(str(row[c]).rjust(widths[c]) for c in cols) for row in rows]
    return "\n".join(lines)


def compare(records: Sequence[RunRecord], *, title: str = "labkit runs"):
    """(rows, figure): the table and a two-panel figure (loss curves; per-rank memory by kind)."""
    import matplotlib.pyplot as plt

    rows = table(records)
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    labels = []
    for r in records:
        label = f"{r.strategy} x{r.world_size}"
        labels.append(label)
        ax_loss.plot(range(1, len(r.losses) + 1), r.losses, label=label)
    ax_loss.set(xlabel="step", ylabel="training loss", title="loss")
    ax_loss.legend(fontsize=8)
    bottom = [0.0] * len(records)
    for kind in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        heights = [max(getattr(r, kind), default=0) / 2**20 for r in records]
        ax_mem.bar(labels, heights, bottom=bottom, label=kind.replace("_bytes", "s"))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax_mem.set(ylabel="MiB per rank (max over ranks)", title="model-state memory per rank")
    ax_mem.tick_params(axis="x", rotation=30)
    ax_mem.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return rows, fig
