"""Which rank's failure is the cause of a multi-rank failure (issue #39).

When one rank fails, its peers fail next: gloo reports "Connection reset by peer" or "Connection closed by
peer" on every rank still talking to it, and a rank that gloo aborts (a C++ `enforce`: "size doesn't match")
dies by a signal without a Python error, so it writes nothing before its peers do. `first_cause` picks the
rank whose failure is its own: the earliest (by the time its error or its last output was written) whose
error is not a lost peer, whether it raised or died by itself; the caller's own SIGKILL of the survivors
never counts. None when every failure reads as a lost peer.
"""
from __future__ import annotations

import signal
from pathlib import Path

#: What a rank says when another rank went away first (gloo's tcp transport, sockets).
PEER_LOSS = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
             "socket closed", "no such process", "end of file")


def is_peer_loss(text: str) -> bool:
    text = text.lower()
    return any(words in text for words in PEER_LOSS)


def _own(work: Path, rank: int, code: int | None) -> tuple[int, str] | None:
    """(when, what) of this rank's own failure, None when it did not fail by itself or lost a peer."""
    import cloudpickle

    error = work / f"error_{rank}.pkl"
    if error.exists():
        _, message, tb = cloudpickle.loads(error.read_bytes())
        return None if is_peer_loss(f"{message}\n{tb}") else (error.stat().st_mtime_ns, message)
    if code in (None, 0, -signal.SIGKILL):  # alive, done, or killed by the caller after another rank failed
        return None
    log = work / f"rank_{rank}.log"
    text = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    return None if is_peer_loss(text) else (log.stat().st_mtime_ns if log.exists() else 0, text)


def first_cause(work: Path, codes: list[int | None]) -> int | None:
    """The rank whose own failure came first (see the module docstring), or None."""
    own = [(found[0], rank) for rank, code in enumerate(codes) if (found := _own(work, rank, code)) is not None]
    return min(own)[1] if own else None
