"""The grader's private copies of a batch's submissions (`labkit grade`).

Before anything runs, every submitted file is copied into a private workspace (a 0700 temp directory that
executed notebooks never see) and hashed; the batch grades the copies. After the batch the originals are
hashed again: a row whose original changed meanwhile says so, and OUT_DIR/received.csv lists every hash.
"""
from __future__ import annotations

import csv
import hashlib
from dataclasses import dataclass
from pathlib import Path

from labkit.course.grading.text import csv_field as _text

RECEIVED_COLUMNS = ("student", "notebook", "sha256", "bytes", "changed_during_batch")


@dataclass(frozen=True)
class Received:
    """One submitted file as the batch received it."""

    original: Path
    copy: Path
    """What is graded: the copy, or the original when it is above the size cap (never read then)."""
    sha256: str
    """Of the bytes copied; '' for a file above the size cap."""
    size: int


def _read(path: Path, max_bytes: int) -> bytes | None:
    """The file's bytes, or None when it is larger than `max_bytes` (not read at all)."""
    if path.stat().st_size > max_bytes:
        return None
    with path.open("rb") as fh:
        data = fh.read(max_bytes + 1)
    return None if len(data) > max_bytes else data


def take(original: Path, root: Path, index: int, max_bytes: int) -> Received:
    """Copy `original` to `root/<index>/<name>` and hash the copy."""
    data = _read(original, max_bytes)
    if data is None:
        return Received(original, original, "", original.stat().st_size)
    copy = root / f"{index:05d}" / original.name
    copy.parent.mkdir(parents=True)
    copy.write_bytes(data)
    return Received(original, copy, hashlib.sha256(data).hexdigest(), len(data))


def changed(received: Received, max_bytes: int) -> str | None:
    """Why the original no longer matches what was graded, or None when it still does."""
    if not received.sha256:
        return None
    try:
        data = _read(received.original, max_bytes)
    except OSError:
        return "the submitted file was deleted while the batch ran"
    if data is None or hashlib.sha256(data).hexdigest() != received.sha256:
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
