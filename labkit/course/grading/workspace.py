"""The grader's private copies of a batch's submissions (`labkit grade`).

Before anything runs, every submitted file is copied into a private workspace (a 0700 temp directory that
executed notebooks never see) and hashed; the batch grades the copies. After the batch the originals are
hashed again: a row whose original changed meanwhile says so, and OUT_DIR/received.csv lists every hash.
"""
from __future__ import annotations

import csv
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from labkit.course.grading.evaluate import SubmissionProblem, read_submitted
from labkit.course.grading.text import csv_field as _text

RECEIVED_COLUMNS = ("student", "notebook", "sha256", "bytes", "changed_during_batch")


@dataclass(frozen=True)
class Received:
    """One submitted file as the batch received it."""

    original: Path
    copy: Path
    """What is graded: the private copy (the original is never read again but to see whether it changed)."""
    sha256: str
    """Of the bytes copied."""
    size: int
    mtime: float = 0.0
    """The original's modification time when it was read (a late policy's last resort)."""


def take(original: Path, root: Path, index: int, max_bytes: int) -> Received:
    """Copy `original` to `root/<index>/<name>` and hash the copy; SubmissionProblem('invalid') for what is not
    a regular file within the cap (evaluate.read_submitted: read once, bounded, never blocks)."""
    data = read_submitted(original, max_bytes)
    copy = root / f"{index:05d}" / original.name
    copy.parent.mkdir(parents=True)
    copy.write_bytes(data)
    try:
        mtime = os.lstat(original).st_mtime
    except OSError:
        mtime = 0.0
    return Received(original, copy, hashlib.sha256(data).hexdigest(), len(data), mtime)


def changed(received: Received, max_bytes: int) -> str | None:
    """Why the original no longer matches what was graded, or None when it still does."""
    try:
        data = read_submitted(received.original, max_bytes)
    except SubmissionProblem as exc:
        if not os.path.lexists(received.original):
            return "the submitted file was deleted while the batch ran"
        return (f"the submitted file changed while the batch ran ({exc}); graded the copy received at the start "
                f"(sha256 {received.sha256[:12]})")
    if hashlib.sha256(data).hexdigest() != received.sha256:
        return (f"the submitted file changed while the batch ran; graded the copy received at the start "
                f"(sha256 {received.sha256[:12]})")
    return None


def write_received(rows: list[tuple[str, str, Received, str | None]], path: Path) -> None:
    """received.csv: (student, notebook, Received, change note) per submitted file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(RECEIVED_COLUMNS)
        for student, notebook, rec, note in rows:
            writer.writerow([_text(student), _text(notebook), rec.sha256, rec.size, "yes" if note else "no"])
