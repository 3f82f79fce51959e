"""Relative links in the course notebooks, and the files a student release carries so none is dead.

A notebook's markdown links to course files outside `notebooks/` (`../docs/memory.md`,
`../reservations/README.md`). `labkit assign` writes the notebooks to OUT/notebooks/, so such a link
resolves to OUT/docs/..., which must exist: `copy_linked` copies every linked file there, at the same
place relative to the notebooks, and then the files those link to (a README's `policy.yaml`). A
link whose target does not exist in the source tree is a `GradingError` naming the notebook, before
the release is handed out. Introduced with `labkit assign` (docs/grading.md).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from labkit.errors import GradingError

#: [text](target) in markdown, and href="target" / src="target" in the HTML a markdown cell may hold.
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|(?:href|src)=\"([^\"]+)\"")
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|#|//)", re.IGNORECASE)  # https:, mailto:, data:, anchors


def links(text: str) -> list[str]:
    """The relative link targets in `text`, without #anchors or ?queries, in order, once each."""
    out = []
    for m in _LINK.finditer(text):
        target = (m.group(1) or m.group(2) or "").split("#")[0].split("?")[0]
        if target and not _EXTERNAL.match(target) and target not in out:
            out.append(target)
    return out


def notebook_links(path: Path) -> list[str]:
    """Relative link targets in the markdown cells of the notebook at `path`."""
    cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    return links("\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown"))


def _linked_from(path: Path) -> list[str]:
    if path.suffix == ".ipynb":
        return notebook_links(path)
    if path.suffix == ".md":
        return links(path.read_text(encoding="utf-8"))
    return []


def linked_files(source: Path) -> list[Path]:
    """Every file the notebooks in `source` link to, directly or through linked markdown and notebooks,
    as paths relative to `source.parent` (the course root); links into `source` itself are left out
    (the release copies that folder anyway). GradingError for a dead link or one outside the root."""
    source = Path(source).resolve()
    root = source.parent
    todo, seen, found = sorted(source.glob("*.ipynb")), set(), []
    while todo:
        page = todo.pop(0)
        for target in _linked_from(page):
            file = (page.parent / target).resolve()
            where = f"{page.relative_to(root)} links to {target!r}"
            if root not in file.parents:
                raise GradingError(f"{where}, outside the course folder {root}; link to a file inside it")
            if not file.exists():
                raise GradingError(f"{where}, which does not exist; fix the link or add the file")
            if file in seen or source in file.parents or file == source:
                continue
            seen.add(file)
            found.append(file.relative_to(root))
            todo.append(file)
    return found


def copy_linked(source: str | Path, out: str | Path) -> list[Path]:
    """Copy the files `linked_files(source)` names into OUT at the same place relative to
    OUT/notebooks as they have relative to `source`; returns the copies."""
    root, out = Path(source).resolve().parent, Path(out)
    copies = []
    for rel in linked_files(Path(source)):
        dest = out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if (root / rel).is_dir():
            shutil.copytree(root / rel, dest, dirs_exist_ok=True)
        else:
            shutil.copy2(root / rel, dest)
        copies.append(dest)
    return copies
