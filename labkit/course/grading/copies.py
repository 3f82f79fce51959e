"""Copied notebooks: two students whose recorded runs measured the very same values (issue #26).

Every measured run records wall-clock timings (median step time, throughput) as full floats: two honest runs,
even of the same code with the same seed on the same node, never agree on them, while a copy does, however
it was re-sealed (the seal's nonce and time are the copier's to choose). `signatures(nb)` gives one digest per
recorded run that has a timing, over its losses, timings and peaks; `find_pairs(rows)` lists the students who
share one, and `flag(rows)` notes it on both rows for the instructor to review. Nobody's score changes: the
files cannot say who copied from whom, and the first submitter must never lose their grade automatically.
"""
from __future__ import annotations

import csv
import hashlib
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from labkit.course.grading.evidence import collect
from labkit.course.grading.fingerprint import canonical

#: The measured values of a run a signature covers; it needs a nonzero step time to mean anything.
MEASURED = ("losses", "step_time_s", "samples_per_s", "tokens_per_s", "peak_bytes")
REVIEW_COLUMNS = ("notebook", "student", "other", "runs_in_common", "same_seals", "code_similarity", "page")


def signatures(nb) -> tuple[str, ...]:
    """One digest per recorded run of `nb` with a measured step time (sorted, without repeats)."""
    out = set()
    for rec in collect(nb):
        record = rec.payload.get("record") if rec.kind == "run" else None
        if not isinstance(record, dict) or not isinstance(record.get("step_time_s"), (int, float)) or \
                not record["step_time_s"]:
            continue
        try:
            text = canonical({k: record.get(k) for k in MEASURED})
        except (TypeError, ValueError):  # a value JSON cannot hold (NaN was stored as text): not comparable
            continue
        out.add(hashlib.sha256(text.encode()).hexdigest())
    return tuple(sorted(out))


@dataclass(frozen=True)
class Pair:
    """Two submissions of one notebook whose recorded runs measured the same values."""

    notebook: str
    student: str
    other: str
    runs: int
    """Recorded runs the two have in common, value for value."""
    same_seals: bool
    """True when the seals are identical too (the same file); False for a re-sealed copy."""


def find_pairs(rows) -> list[Pair]:
    """Every pair of students (each once, in name order) sharing a run signature in the same notebook."""
    owners: dict[tuple[str, str], set[str]] = defaultdict(set)
    by_key = {(r.student, r.notebook): r for r in rows}
    for row in rows:
        for sig in row.signatures:
            owners[(row.notebook, sig)].add(row.student)
    shared: dict[tuple[str, str, str], int] = defaultdict(int)
    for (notebook, _), students in owners.items():
        ordered = sorted(students)
        for i, a in enumerate(ordered):
            for b in ordered[i + 1:]:
                shared[(notebook, a, b)] += 1
    pairs = []
    for (notebook, a, b), runs in sorted(shared.items()):
        seals = set(by_key[(a, notebook)].digests) & set(by_key[(b, notebook)].digests)
        pairs.append(Pair(notebook, a, b, runs, bool(seals)))
    return pairs


def flag(rows, pairs: list[Pair]):
    """`rows` with a review note (instructors' eyes only: grades.csv, review.csv) on both students of each pair."""
    notes: dict[tuple[str, str], list[str]] = defaultdict(list)
    for p in pairs:
        how = "the same seals: one file" if p.same_seals else "under other seals: re-sealed"
        for me, other in ((p.student, p.other), (p.other, p.student)):
            notes[(me, p.notebook)].append(f"{p.runs} recorded run(s) identical to {other}'s ({how})")
    out = []
    for row in rows:
        mine = notes.get((row.student, row.notebook))
        out.append(replace(row, review="review: " + "; ".join(mine) + " (review.csv)") if mine else row)
    return out


def write_review(pairs: list[Pair], path: Path, code_pairs=()) -> Path:
    """review.csv: one line per pair of submissions to look at, copied runs (`pairs`) and alike code
    (`code_pairs`, labkit.course.grading.similarity) joined by (notebook, student, other); empty but for its
    header when none."""
    from labkit.course.grading.text import csv_field as _text

    lines: dict[tuple[str, str, str], list] = {}
    for p in pairs:
        lines[(p.notebook, p.student, p.other)] = [p.runs, "yes" if p.same_seals else "no", "", ""]
    for c in code_pairs:
        line = lines.setdefault((c.notebook, c.student, c.other), [0, "", "", ""])
        line[2:] = [f"{c.similarity:g}", c.page]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(REVIEW_COLUMNS)
        for (notebook, student, other), rest in sorted(lines.items()):
            writer.writerow([_text(notebook), _text(student), _text(other), *rest])
    return path
