"""Copied exercise code: two students whose exercise cells match once names are set aside (issue #40 item 7).

A student who copies another's code and re-executes it has new seals and, in a lab that records no run
(lab 01), nothing labkit.course.grading.copies can compare. Their code still matches. Each submission's
exercise cells (Grade.code) are fingerprinted as MOSS does, by winnowing (Schleimer, Wilkerson & Aiken,
"Winnowing: local algorithms for document fingerprinting", SIGMOD 2003) through copydetect: the code is
tokenized by pygments, every name becomes `V` / `F`, strings `S`, comments and spaces are dropped, and the
hashes of its k-grams (k = 25 characters of that text) are winnowed (one per window of 6): renamed variables
and functions, moved functions, new comments and blank lines change nothing. The release's own code (the
exercise cells as `labkit assign` stubs them: signatures, imports) is boilerplate and never counts.

Two submissions of one notebook whose fingerprints overlap by at least `threshold` (of either one's code) are a
pair: review.csv lists it with `code_similarity`, and `review/pair-NNN.html` shows both codes side by side with
the shared parts marked. As for copied runs, nobody's score changes.
"""
from __future__ import annotations

import html
import io
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

#: Characters of filtered code per k-gram and the winnowing window: copydetect's defaults (noise 25, guarantee 30).
K, WINDOW = 25, 6
#: Code kept per submission (Grade.code): a notebook's exercise cells are a few KiB.
MAX_CODE = 256 * 2**10
DEFAULT_THRESHOLD = 0.7
#: Fewest shared characters of filtered code (about three statements) that make a pair: two short answers that
#: share a line or two (a signature and `return`) are what honest work gives.
MIN_OVERLAP = 100


def code_of(nb) -> str:
    """The exercise cells of `nb` (labkit.course.exercises.source), in exercise-id order, capped at MAX_CODE."""
    from labkit.course.exercises.source import exercise_cells
    from labkit.course.grading.text import clean

    cells = exercise_cells(nb)
    return clean("\n\n".join(cells[k] for k in sorted(cells)), MAX_CODE)


@lru_cache(maxsize=64)
def boilerplate(notebook: str) -> tuple[int, ...]:
    """Fingerprints of the release's exercise cells of `notebook` (the source tree's, stubbed); () without it."""
    import nbformat

    from labkit.course.exercises.grading import source_tests_dir
    from labkit.course.exercises.source import exercise_cells, stub

    path = source_tests_dir().parent / f"{notebook}.ipynb"
    try:
        cells = exercise_cells(nbformat.read(str(path), as_version=4))
        code = "\n\n".join(stub(cells[k], k) for k in sorted(cells))
    except Exception:  # noqa: BLE001 - no source tree (an installed wheel), or markers it cannot stub
        return ()
    return tuple(int(h) for h in _fingerprint(code, ()).hashes) if code else ()


def _fingerprint(code: str, skip: tuple[int, ...]):
    from copydetect import CodeFingerprint

    return CodeFingerprint("code.py", K, WINDOW, boilerplate=list(skip), language="python", fp=io.StringIO(code))


@dataclass(frozen=True)
class CodePair:
    """Two submissions of one notebook whose exercise code overlaps."""

    notebook: str
    student: str
    other: str
    similarity: float
    """The larger of the two overlaps (shared fingerprints' tokens / each one's tokens), 0-1."""
    page: str
    """review/pair-NNN.html: the two codes side by side."""
    left: str = ""
    right: str = ""
    """Both codes as HTML with the shared parts marked (written to `page`, not kept in review.csv)."""


def find_pairs(rows, threshold: float = DEFAULT_THRESHOLD) -> list[CodePair]:
    """Every pair of students (in name order) of one notebook whose code overlaps by >= `threshold`."""
    if not 0 < threshold <= 1:
        return []
    by_nb: dict[str, list] = {}
    for row in rows:
        if row.code.strip():
            by_nb.setdefault(row.notebook, []).append(row)
    if not any(len(group) > 1 for group in by_nb.values()):
        return []
    from copydetect import compare_files  # imports matplotlib: only when there is code to compare
    from copydetect.utils import highlight_overlap

    found = []
    for notebook, group in sorted(by_nb.items()):
        skip = boilerplate(notebook)
        prints = [(r, _fingerprint(r.code, skip)) for r in sorted(group, key=lambda r: r.student)]
        for i, (a, fa) in enumerate(prints):
            for b, fb in prints[i + 1:]:
                if not fa.hashes or not fb.hashes or not fa.hashes & fb.hashes:
                    continue
                overlap, sims, slices = compare_files(fa, fb)
                similarity = float(max(sims))
                if similarity >= threshold and overlap >= MIN_OVERLAP:
                    left = highlight_overlap(fa.raw_code, slices[0], "<mark>", "</mark>", escape_html=True)[0]
                    right = highlight_overlap(fb.raw_code, slices[1], "<mark>", "</mark>", escape_html=True)[0]
                    found.append(CodePair(notebook, a.student, b.student, round(similarity, 3), "", left, right))
    return [CodePair(p.notebook, p.student, p.other, p.similarity, f"review/pair-{i:03d}.html", p.left, p.right)
            for i, p in enumerate(found, 1)]


_CSS = ("body{font-family:system-ui,sans-serif;margin:1rem}.cols{display:flex;gap:1rem}.cols>div{flex:1;"
        "min-width:0}pre{background:#f6f6f6;padding:.5rem;overflow:auto;font-size:.85rem}mark{background:#ffd54f}")


def page(pair: CodePair) -> str:
    from labkit.course.grading.text import clean

    a, b, nb = (html.escape(clean(x, 300)) for x in (pair.student, pair.other, pair.notebook))
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>review: {a} and {b}</title>"
            f"<style>{_CSS}</style></head><body><h1>{nb}: {a} and {b}</h1><p>Exercise code "
            f"{pair.similarity:.0%} alike once names, comments and layout are set aside (winnowing, as MOSS does). "
            "Marked: the parts they share. Nobody's score changed; the files cannot say who copied from whom.</p>"
            f"<div class=\"cols\"><div><h2>{a}</h2><pre>{pair.left}</pre></div><div><h2>{b}</h2>"
            f"<pre>{pair.right}</pre></div></div></body></html>\n")


def write_pages(pairs: Sequence[CodePair], out_dir: Path) -> list[str]:
    """review/pair-NNN.html for every pair; the problems, one line each."""
    problems = []
    for pair in pairs:
        try:
            (out_dir / pair.page).parent.mkdir(parents=True, exist_ok=True)
            (out_dir / pair.page).write_text(page(pair), encoding="utf-8")
        except OSError as exc:
            problems.append(f"{pair.page} not written: {exc.strerror}")
    return problems


def flag(rows, pairs: Sequence[CodePair]):
    """`rows` with a review note (grades.csv only, never feedback) on both students of each pair."""
    from dataclasses import replace

    notes: dict[tuple[str, str], list[str]] = {}
    for p in pairs:
        for me, other in ((p.student, p.other), (p.other, p.student)):
            notes.setdefault((me, p.notebook), []).append(
                f"exercise code {p.similarity:.0%} alike {other}'s ({p.page})")
    out = []
    for row in rows:
        mine = notes.get((row.student, row.notebook))
        note = "review: " + "; ".join(mine) if mine else ""
        out.append(replace(row, review="; ".join(filter(None, (row.review, note)))) if mine else row)
    return out
