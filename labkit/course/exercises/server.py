"""The student's side of a code exercise: `python -m labkit.course.exercises.server SCRATCH MEMORY --channel-fd N`.

Runs inside the grading sandbox (labkit.course.grading.isolation) and holds nothing of the tests: no test
file, no expected value, no report to forge. The grader (labkit.course.exercises.judge) sends requests on
the channel -- load a cell, call the function, run a harness, spawn ranks -- pickled by the grader; this
process answers each with plain data only (labkit.course.exercises.wire), which the grader checks and
compares itself. Student code here can read or write the channel as it likes: what it sends is, at best,
another answer, and answers are all the grader ever takes from it.

`perform` is also what `LocalStudent` runs in a student's own notebook, so both paths answer alike.
"""
from __future__ import annotations

import os
import socket
import struct
import sys
from typing import Callable

#: Largest request read from the grader (pickled arguments: a small model at most).
_MAX_REQUEST = 2**30


class CellError(Exception):
    """The exercise cell could not be loaded: it raised, or defines no function of the exercise's name."""


def load_cell(exercise: str, source: str) -> Callable:
    """Execute an exercise cell in a fresh namespace and return its function `exercise`."""
    from labkit.course.exercises.source import to_python

    namespace = {"__name__": "labkit_submission"}
    try:
        code = to_python(source)
        if "get_ipython()" in code:  # a magic (%time, %%writefile): run it as IPython would
            from IPython.core.interactiveshell import InteractiveShell

            namespace["get_ipython"] = InteractiveShell.instance
        exec(compile(code, f"<exercise {exercise}>", "exec"), namespace)  # noqa: S102 - the student's cell
    except BaseException as exc:  # noqa: BLE001 - the cell itself fails: every test fails with this reason
        raise CellError(f"the exercise cell raised {type(exc).__name__}: {_text(exc)[:200]}") from None
    fn = namespace.get(exercise)
    if not callable(fn):
        raise CellError(f"the exercise cell defines no function {exercise}(); restore its `def {exercise}(...)`")
    return fn


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a student's exception with a broken __str__
        return "<unprintable>"


def perform(fn: Callable, request: dict, reraise: tuple = ()) -> dict:
    """Answer one request with the student's `fn`: {"kind": "value", "value": ...} or an error envelope."""
    from labkit.course.exercises.cases import ExerciseError

    op = request["op"]
    try:
        if op == "call":
            value = fn(*request["args"], **request["kwargs"])
        elif op == "run":
            value = request["harness"](fn, *request["args"], **request["kwargs"])
        elif op == "spawn":
            from labkit.course.exercises.spawn import spawn

            value = spawn(request["harness"], world=request["world"], args=(fn, *request["args"]),
                          timeout=request["timeout"], imports=request.get("imports", ()))
        else:
            return {"kind": "error", "type": "ProtocolError", "message": f"unknown request {op!r}"}
    except reraise:
        raise
    except BaseException as exc:  # noqa: BLE001 - whatever the student's code raised is its answer
        stub = isinstance(exc, NotImplementedError) or (isinstance(exc, ExerciseError) and exc.not_attempted)
        return {"kind": "error", "type": type(exc).__name__[:80], "message": _text(exc)[:500],
                "rank": getattr(exc, "rank", None) if isinstance(exc, ExerciseError) else None,
                "not_attempted": stub}
    return {"kind": "value", "value": value}


# ---------------------------------------------------------------- the process
def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 2**20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _receive(sock: socket.socket):
    import cloudpickle

    head = _recv_exact(sock, 8)
    if head is None:
        return None
    (size,) = struct.unpack(">Q", head)
    if size > _MAX_REQUEST:
        return None
    body = _recv_exact(sock, size)
    return None if body is None else cloudpickle.loads(body)  # the grader's own bytes


def _close_other_fds(keep: int) -> None:
    """Nothing but stdio and the channel stays open when student code runs."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 256))
    for fd in fds:
        if fd > 2 and fd != keep:
            try:
                os.close(fd)
            except OSError:
                pass


def serve(sock: socket.socket) -> int:
    from labkit.course.exercises import wire

    _send(sock, wire.encode({"kind": "ready", "seq": 0}))  # before any student code: the grader's clock starts
    fn = None
    while True:
        request = _receive(sock)
        if request is None or request.get("op") == "bye":
            return 0
        if request["op"] == "load":
            try:
                fn, answer = load_cell(request["exercise"], request["source"]), {"kind": "value", "value": None}
            except CellError as exc:
                fn, answer = None, {"kind": "error", "type": "CellError", "message": str(exc)}
        elif fn is None:
            answer = {"kind": "error", "type": "CellError", "message": "no exercise cell is loaded"}
        else:
            answer = perform(fn, request)
        answer["seq"] = request["seq"]
        sys.stdout.flush()
        _send(sock, wire.encode(answer))


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack(">Q", len(payload)) + payload)


def main(argv: list[str]) -> int:
    from labkit.course.exercises.process import child_args
    from labkit.course.exercises.spawn import prewarm, warm_ranks

    args = child_args(argv, "labkit.course.exercises.server", "--channel-fd")
    _close_other_fds(args.fd)
    devnull = os.open(os.devnull, os.O_RDONLY)  # nothing to read on stdin
    os.dup2(devnull, 0)
    os.close(devnull)
    with warm_ranks():  # every variant's tests may spawn ranks: fork them from one process that imported torch
        if args.warm is not None:  # the grader's hint that the tests spawn: ready them before the first request
            prewarm(tuple(m for m in args.warm.split(",") if m))  # (issue #39)
        return serve(socket.socket(fileno=args.fd))


def _exit(code: int) -> None:
    """Exit without the interpreter's teardown: nothing here needs one (the forkserver and its ranks are reaped
    in `warm_ranks`, the scratch is the grader's to remove, a student's atexit is no business of ours), and
    with torch imported it takes a second or more that the grader would wait for (issue #39)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a stream the student's code closed or replaced
            pass
    os._exit(code)


if __name__ == "__main__":
    _exit(main(sys.argv[1:]))
