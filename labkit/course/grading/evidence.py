"""What a check sees: the recorded results and answers of one executed notebook, read as data.

A notebook is only read here, never executed; every accessor that cannot find what a check needs raises
`CheckFailed` with the fix the student should make.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from labkit.errors import ConfigError, GradingError
from labkit.results import MIME, RunRecord

#: nb.metadata[IDENTITY_KEY[0]][IDENTITY_KEY[1]] names the course notebook, e.g. {"labkit": {"notebook": "01_memory"}}.
IDENTITY_KEY = ("labkit", "notebook")
IMAGE_MIMES = ("image/png", "image/svg+xml", "image/jpeg")


class CheckFailed(GradingError):
    """Raised inside a check: the message tells the student what to fix."""


@dataclass(frozen=True)
class Recorded:
    """One labkit payload found in an output of cell `cell` (its text/plain alongside)."""

    cell: int
    payload: dict[str, Any]
    text: str | None

    @property
    def kind(self) -> str:
        return str(self.payload.get("kind", ""))

    @property
    def key(self) -> str:
        return str(self.payload.get("key", ""))


def identity(nb) -> str | None:
    """The course notebook name stored in the notebook's metadata, or None."""
    meta = nb.get("metadata", {}).get(IDENTITY_KEY[0], {})
    value = meta.get(IDENTITY_KEY[1]) if isinstance(meta, dict) else None
    return value if isinstance(value, str) else None


#: Tags of cells papermill adds (parameters it injects, error banners): not part of the student's notebook.
PAPERMILL_TAGS = ("injected-parameters", "papermill-error-cell-tag")


def cell_number(nb, index: int) -> int:
    """1-based number of cell `index` as the student counts them: papermill's added cells left out."""
    added = sum(any(t in PAPERMILL_TAGS for t in c.get("metadata", {}).get("tags", [])) for c in nb.cells[:index])
    return index - added + 1


def code_cells(nb) -> Iterator[tuple[int, Any]]:
    for index, cell in enumerate(nb.cells):
        if cell.get("cell_type") == "code":
            yield index, cell


def collect(nb) -> list[Recorded]:
    """Every labkit payload in any cell's outputs (markdown cells included: tamper checks flag those)."""
    found = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []) or []:
            data = output.get("data", {}) if isinstance(output, dict) else {}
            if isinstance(data, dict) and isinstance(data.get(MIME), dict):
                text = data.get("text/plain")
                found.append(Recorded(index, dict(data[MIME]), text if isinstance(text, str) else None))
    return found


def _literal_assignments(source: str) -> dict[str, Any]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


def parameters(nb) -> dict[str, Any]:
    """Notebook parameters: the `parameters` cell's literals, overridden by papermill's injected ones."""
    params: dict[str, Any] = {}
    for tag in ("parameters", "injected-parameters"):
        for _, cell in code_cells(nb):
            if tag in cell.get("metadata", {}).get("tags", []):
                params.update(_literal_assignments(cell.get("source", "")))
    return params


def error_of(cell) -> str | None:
    """'ename: evalue' of the first error output of a cell, or None."""
    for output in cell.get("outputs", []) or []:
        if output.get("output_type") == "error":
            return f"{output.get('ename', 'Error')}: {output.get('evalue', '')}"[:300]
    return None


@dataclass(frozen=True)
class Evidence:
    """The executed notebook `nb` of course notebook `notebook`, with its labkit payloads."""

    notebook: str
    nb: Any
    recorded: tuple[Recorded, ...]
    params: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_notebook(cls, nb, notebook: str | None = None) -> "Evidence":
        return cls(notebook or identity(nb) or "", nb, tuple(collect(nb)), parameters(nb))

    @property
    def profile(self) -> str:
        return str(self.params.get("PROFILE", "smoke"))

    @property
    def on_cpu(self) -> bool:
        """True for a CPU profile (smoke, smoke-bf16, or an unknown name): timing floors do not apply."""
        from labkit.profiles import PROFILES

        make = PROFILES.get(self.profile)
        return make is None or make().device == "cpu"

    def _last(self, kind: str, key: str) -> Recorded:
        for rec in reversed(self.recorded):
            if rec.kind == kind and rec.key == key:
                return rec
        call = f"answer({key!r}, ...)" if kind == "answer" else f"show(record, key={key!r})"
        raise CheckFailed(f"no {kind} {key!r} recorded; run the cell that calls labkit.results.{call} "
                          f"and save the notebook")

    def answer(self, key: str) -> Any:
        """The last value recorded with `labkit.results.answer(key, value)`."""
        return self._last("answer", key).payload.get("value")

    def run(self, key: str) -> RunRecord:
        """The last RunRecord shown with `labkit.results.show(record, key=...)` (key defaults to strategy)."""
        data = self._last("run", key).payload.get("record")
        try:
            return RunRecord.from_dict(dict(data))
        except (ConfigError, TypeError, ValueError) as exc:
            raise CheckFailed(f"run {key!r} is not a valid RunRecord ({exc}); re-run its cell") from exc

    def cell_of(self, kind: str, key: str) -> int:
        return self._last(kind, key).cell

    def tagged(self, tag: str) -> list[int]:
        return [i for i, cell in code_cells(self.nb) if tag in cell.get("metadata", {}).get("tags", [])]

    def has_image(self, cells: list[int] | None = None) -> bool:
        indices = cells if cells is not None else [i for i, _ in code_cells(self.nb)]
        for i in indices:
            for output in self.nb.cells[i].get("outputs", []) or []:
                if any(m in output.get("data", {}) for m in IMAGE_MIMES):
                    return True
        return False
