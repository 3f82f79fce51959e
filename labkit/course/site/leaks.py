"""What the course website must never show: solution text and hidden tests.

The secrets are read from the real sources: every line inside a `# BEGIN SOLUTION` region and every
one-line `# SOLUTION` answer of the source notebooks, and every line of the hidden tests
(notebooks/tests/hidden/*.py). A line that the public material also holds anywhere (the student release,
the visible tests, labkit's own source, the slides and docs) is not a secret: the site may show it where the release does. What
is left is matched, whitespace-collapsed, against a page's text (its code, prose and outputs alike), so
a printed answer counts as a leak as much as a solution line does.
"""
from __future__ import annotations

import functools
import html.parser
import json
import re
from dataclasses import dataclass
from pathlib import Path

from labkit.course.exercises.source import solution_lines

#: Shorter lines (`return x`, `)`) say nothing about a solution and occur anywhere.
MIN_CHARS = 16
_SPACE = re.compile(r"\s+")


def _norm(text: str) -> str:
    return _SPACE.sub(" ", text).strip()


@dataclass(frozen=True)
class Secret:
    text: str
    """Whitespace-collapsed line."""
    origin: str
    """Where it comes from, e.g. '03_ddp.ipynb cell 27 (solution)' or 'hidden/03_ddp.py line 12'."""


def _public_text(notebooks: Path, released: dict[str, str]) -> str:
    """Everything a learner may read anyway, whitespace-collapsed: the release, the visible tests, labkit's
    source, the slides, the docs and the README (a secret is only what none of them contains)."""
    import labkit

    root = notebooks.parent
    texts = list(released.values())
    for folder, pattern in ((notebooks / "tests", "*.py"), (Path(labkit.__file__).parent, "**/*.py"),
                            (root / "slides", "*.md"), (root / "docs", "*.md")):
        texts += [p.read_text() for p in sorted(folder.glob(pattern))]
    texts += [p.read_text() for p in (root / "README.md",) if p.is_file()]
    return "\n".join(_norm(line) for text in texts for line in text.splitlines())


def secrets(notebooks: str | Path) -> tuple[Secret, ...]:
    """The solution and hidden-test lines of the course in `notebooks` that no public file holds."""
    return _secrets(str(Path(notebooks).resolve()))


@functools.lru_cache(maxsize=4)  # the sources do not change while a build or a test session runs
def _secrets(notebooks: str) -> tuple[Secret, ...]:
    import nbformat

    from labkit.course.exercises.release import released_notebook

    notebooks = Path(notebooks)
    paths = sorted(notebooks.glob("*.ipynb"))
    released = {p.name: "\n".join(c.source for c in released_notebook(p).cells) for p in paths}
    public = _public_text(notebooks, released)
    found: dict[str, Secret] = {}

    def add(line: str, origin: str) -> None:
        text = _norm(line)
        if len(text) >= MIN_CHARS and text not in public and text not in found:
            found[text] = Secret(text, origin)

    for path in paths:
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells, start=1):
            if cell.cell_type == "code":
                for line in solution_lines(cell.source):
                    add(line, f"{path.name} cell {i} (solution)")
    for path in sorted((notebooks / "tests" / "hidden").glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            add(line, f"tests/hidden/{path.name} line {n}")
    return tuple(found.values())


def find_leaks(text: str, known: tuple[Secret, ...]) -> list[Secret]:
    """The secrets that occur in `text` (a page's visible text or HTML)."""
    page = _norm(text)
    return [s for s in known if s.text in page]


# ---- the built site --------------------------------------------------------------------------------------

class _Text(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_data(self, data):
        self.parts.append(data)


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def site_text(path: Path) -> str:
    """What a built file shows or carries: an HTML page's text (markup removed), a JSON file's strings."""
    raw = path.read_text(errors="replace")
    if path.suffix == ".json":
        try:
            return "\n".join(_strings(json.loads(raw)))
        except json.JSONDecodeError:
            return raw
    parser = _Text()
    parser.feed(raw)
    return "".join(parser.parts)


def scan_site(out: Path, notebooks: Path) -> list[str]:
    """'<file>: <secret> (<origin>)' for every solution or hidden-test line found in the built site."""
    known = secrets(notebooks)
    found = []
    for path in sorted(p for p in out.rglob("*") if p.suffix in (".html", ".json", ".txt", ".ipynb", ".md", ".svg")):
        for secret in find_leaks(site_text(path), known):
            found.append(f"{path.relative_to(out)}: {secret.text!r} ({secret.origin})")
    return found
