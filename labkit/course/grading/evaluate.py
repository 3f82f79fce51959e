"""Grade one executed notebook on its recorded results: read it safely, check identity and seals, run checks.

Used by `labkit check` (visible checks, integrity problems shown as things to fix) and by `labkit grade`
(every check; any integrity problem makes the row `tampered`).
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from labkit.errors import GradingError
from labkit.course.grading import tamper
from labkit.course.grading.checks import Check, CheckResult
from labkit.course.grading.evidence import IDENTITY_KEY, Evidence, identity

GRADED, ERROR, TIMEOUT, INVALID, TAMPERED = "graded", "error", "timeout", "invalid", "tampered"
#: A notebook executed as a rehearsal (labkit.runtime.rehearsal): stand-in models on CPU, nothing measured.
REHEARSAL = "rehearsal"
#: A rostered student with no such submission (labkit grade --roster).
MISSING = "missing"
STATUSES = (GRADED, ERROR, TIMEOUT, INVALID, TAMPERED, REHEARSAL, MISSING)
#: Largest submitted notebook read into memory (a few figures make a course notebook ~1-5 MB).
DEFAULT_MAX_BYTES = 50 * 2**20


class SubmissionProblem(GradingError):
    """A submission that gets a non-graded status; the message is the row's reason."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Grade:
    """One row of the gradebook (grades.csv) plus the per-check results behind it."""

    student: str
    notebook: str
    status: str
    score: float
    max_score: float
    detail: str
    results: tuple[CheckResult, ...] = ()
    digests: tuple[str, ...] = ()
    """Seal digests of the submitted notebook's results (a copy of the same file shares them)."""
    signatures: tuple[str, ...] = ()
    """Digests of the measured values of its recorded runs (labkit.course.grading.copies: a copy shares them)."""
    review: str = ""
    """A note for the instructor (grades.csv, never the student's feedback): e.g. runs identical to another's."""
    code: str = ""
    """The submitted exercise cells (labkit.course.grading.similarity compares them across students)."""
    runs: tuple[tuple, ...] = ()
    """(key, strategy, ranks, throughput, peak GiB) of its recorded runs (report.html, labkit.course.grading.report)."""
    answers: tuple[tuple[str, str], ...] = ()
    """(check name, answer text) of its `manual` checks, for the TA's review (labkit.course.grading.manual)."""
    submitted_at: str = ""
    """When it was handed in (UTC, labkit.course.grading.late), set only under a --deadline."""
    days_late: int = 0
    late_penalty: float = 0.0
    """Points taken from `score` for lateness (already deducted)."""


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


def _not_regular(name: str, mode: int) -> SubmissionProblem:
    if stat.S_ISLNK(mode):
        return SubmissionProblem(INVALID, f"{name} is a symbolic link, not a file; submit the notebook itself "
                                 "(a link can point at anyone's work)")
    kind = next((what for test, what in _KINDS if test(mode)), "not a regular file")
    return SubmissionProblem(INVALID, f"{name} is {kind}, not a notebook file; submit the .ipynb file itself")


def _too_big(name: str, size: int, max_bytes: int) -> SubmissionProblem:
    return SubmissionProblem(INVALID, f"{name} is {size / 2**20:.1f} MiB, above the {max_bytes / 2**20:.0f} MiB "
                             "cap; clear huge outputs and save again")


def read_submitted(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES, *, follow: bool = False) -> bytes:
    """The bytes of the regular file `path`, read once: SubmissionProblem('invalid') for anything else.

    A submissions folder is anyone's: `path` is lstat-ed (a symbolic link, FIFO, device or folder is refused
    by its type, never opened), then opened with O_NOFOLLOW | O_NONBLOCK (a link or FIFO swapped in meanwhile
    neither redirects nor blocks the open) under its parent folder opened with O_NOFOLLOW too; the open
    descriptor must be a regular file and the same one lstat saw, and at most `max_bytes` + 1 bytes are read
    from it (a device reports size 0; a file that grows is still bounded). Nothing falls back to the path.
    `follow`: the caller's own path (`labkit check`), whose links are resolved first; still only a regular
    file is read.
    """
    path = Path(path).resolve() if follow else Path(path)
    name = path.name
    try:
        before = os.lstat(path)
    except OSError as exc:
        raise SubmissionProblem(INVALID, f"cannot read {name}: {exc.strerror}") from exc
    if not stat.S_ISREG(before.st_mode):
        raise _not_regular(name, before.st_mode)
    if before.st_size > max_bytes:
        raise _too_big(name, before.st_size, max_bytes)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        parent = os.open(path.parent, flags | os.O_DIRECTORY)
        try:
            fd = os.open(name, flags, dir_fd=parent)
        finally:
            os.close(parent)
    except OSError as exc:  # ELOOP: a link swapped in after lstat
        raise SubmissionProblem(INVALID, f"cannot read {name}: {exc.strerror} (was it replaced while the batch "
                                "read it?)") from exc
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode):
            raise _not_regular(name, now.st_mode)
        if (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
            raise SubmissionProblem(INVALID, f"{name} was replaced while the batch read it; grade it again")
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 2**20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise SubmissionProblem(INVALID, f"cannot read {name}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise _too_big(name, max(len(data), now.st_size), max_bytes)
    return data


def load_notebook(path: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_BYTES, follow: bool = True):
    """The nbformat v4 node of `path`; SubmissionProblem('invalid') for anything that is not one.

    Read by `read_submitted`: the size is checked before a byte is read, so a 10 GB file costs nothing, and
    only a regular file is read at all (`follow=False`: a symbolic link is refused, as for a submission).
    """
    path = Path(path)
    return parse_notebook(read_submitted(path, max_bytes, follow=follow), path.name)


def import_nbformat():
    """nbformat, imported in a tenth of the time: it imports jsonschema, whose format checkers import
    rfc3987_syntax when installed (a Jupyter dependency's extra), which builds a lark grammar on import (~1 s
    of every `labkit check`, issue #39). nbformat validates with fastjsonschema and never uses those checkers,
    so here that module loads when its first function is called instead; jsonschema's "iri" checks still work."""
    import importlib
    import importlib.util
    import sys
    import types

    if "nbformat" in sys.modules or "rfc3987_syntax" in sys.modules or not importlib.util.find_spec("rfc3987_syntax"):
        import nbformat

        return nbformat

    def real():
        if sys.modules.get("rfc3987_syntax") is lazy:
            del sys.modules["rfc3987_syntax"]
        return importlib.import_module("rfc3987_syntax")

    lazy = types.ModuleType("rfc3987_syntax", "loads the real rfc3987_syntax when first used")
    lazy.is_valid_syntax = lambda *args, **kwargs: real().is_valid_syntax(*args, **kwargs)

    def attribute(attr: str):
        if attr.startswith("__"):  # the import system asks for __path__, __spec__: not a reason to load it
            raise AttributeError(attr)
        return getattr(real(), attr)

    lazy.__getattr__ = attribute
    sys.modules["rfc3987_syntax"] = lazy
    try:
        import nbformat
    finally:
        if sys.modules.get("rfc3987_syntax") is lazy:
            del sys.modules["rfc3987_syntax"]
    return nbformat


def parse_notebook(raw: bytes, name: str):
    """The nbformat v4 node of the bytes `raw` of file `name`; SubmissionProblem('invalid') otherwise."""
    nbformat = import_nbformat()

    try:
        text = raw.decode("utf-8")
        data = json.loads(text)
    except UnicodeDecodeError as exc:
        raise SubmissionProblem(INVALID, f"{name} is not UTF-8 text ({exc.reason})") from exc
    except json.JSONDecodeError as exc:
        raise SubmissionProblem(INVALID, f"{name} is not valid JSON (line {exc.lineno}, column "
                                f"{exc.colno}: {exc.msg}); download the notebook again from Jupyter") from exc
    except RecursionError as exc:
        raise SubmissionProblem(INVALID, f"{name} nests JSON too deeply to be a notebook") from exc
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise SubmissionProblem(INVALID, f"{name} is JSON but not a Jupyter notebook (no 'cells' list)")
    if data.get("nbformat") != 4:
        raise SubmissionProblem(INVALID, f"{name} has nbformat {data.get('nbformat')!r}, not 4; open and "
                                f"save it in a current Jupyter")
    try:
        nb = nbformat.reads(text, as_version=4, capture_validation_error={})
        for cell in nb.cells:  # touch what grading relies on, so a malformed cell fails here
            if not isinstance(cell.get("source", ""), str) or not isinstance(cell.get("outputs", []), list):
                raise ValueError("a cell has a malformed source or outputs")
    except Exception as exc:  # noqa: BLE001 - nbformat raises many types on malformed input
        raise SubmissionProblem(INVALID, f"{name} is not a valid notebook ({type(exc).__name__}: "
                                f"{str(exc)[:200]})") from exc
    return nb


def check_identity(nb, expected: str) -> None:
    """SubmissionProblem('invalid') unless the notebook says it is course notebook `expected`."""
    found = identity(nb)
    key = ".".join(("metadata",) + IDENTITY_KEY)
    if found is None:
        raise SubmissionProblem(INVALID, f"no {key} in the notebook, so it is not a course notebook; "
                                f"submit your copy of {expected}.ipynb")
    if found != expected:
        raise SubmissionProblem(INVALID, f"wrong notebook: this is {found!r} ({key}), expected {expected!r}")


def run_checks(nb, notebook: str, checks: Sequence[Check]) -> tuple[CheckResult, ...]:
    evidence = Evidence.from_notebook(nb, notebook)
    return tuple(check.run(evidence) for check in checks)


def summarize(results: Sequence[CheckResult]) -> str:
    failed = [r.name + ("" if r.visible else " (hidden)") for r in results if not r.passed]
    head = f"{len(results) - len(failed)}/{len(results)} checks pass"
    return head + (f"; failed: {'; '.join(failed)}" if failed else "")


def join_reasons(reasons: Sequence[str], limit: int = 3) -> str:
    more = f" (+{len(reasons) - limit} more)" if len(reasons) > limit else ""
    return "; ".join(reasons[:limit]) + more


def grade_notebook(nb, notebook: str, checks: Sequence[Check], *, student: str = "",
                   integrity: bool = True) -> Grade:
    """Grade an already loaded notebook: identity, then seals (`integrity`), then every check."""
    max_score = float(sum(c.points for c in checks))
    try:
        check_identity(nb, notebook)
        rehearsed = tamper.rehearsed(nb)
        if rehearsed:
            raise SubmissionProblem(REHEARSAL, f"{rehearsed}: a rehearsal's stand-in results are not measurements; "
                                    "execute the notebook on the node (or in smoke) and submit that")
        reasons = tamper.problems(nb) if integrity else []
        if reasons:
            raise SubmissionProblem(TAMPERED, join_reasons(reasons))
    except SubmissionProblem as exc:
        return Grade(student, notebook, exc.status, 0.0, max_score, str(exc))
    results = run_checks(nb, notebook, checks)
    score = float(sum(r.earned for r in results))
    return Grade(student, notebook, GRADED, score, max_score, summarize(results), results,
                 answers=manual_answers(nb, notebook, checks))


def manual_answers(nb, notebook: str, checks: Sequence[Check]) -> tuple[tuple[str, str], ...]:
    """(name, text) of the answer each `manual` check reads (20,000 characters at most)."""
    from labkit.course.grading.text import clean

    evidence, out = Evidence.from_notebook(nb, notebook), []
    for check in checks:
        if check.kind == "manual" and check.reads:
            try:
                out.append((check.name, clean(evidence.answer(check.reads[0][1]), 20_000)))
            except Exception:  # noqa: BLE001 - no such answer: nothing to mark
                continue
    return tuple(out)
