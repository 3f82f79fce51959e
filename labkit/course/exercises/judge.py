"""Judge one exercise: its tests run HERE, in the grader's process; the student's code runs in its own (issue #26).

`judge(exercise, sources, cases, ...)` starts one process for the student's side
(labkit.course.exercises.server, in the grading sandbox when an isolation is given) and, for each source
variant (the submitted cell; in CI the solution and its mutants), loads the cell there and runs every case
here with a `RemoteStudent`: each `student.call / run / spawn` is one request on a socket, answered with
plain data (labkit.course.exercises.wire) that this process checks and compares. Names, points and
visibility come from the loaded cases, statuses are decided here, and nothing the student's process
writes is a verdict. Visible cases run before hidden ones, so what a hidden test sends cannot come back in
a visible test's message. The process serves all the variants (a new one only after a variant killed it);
it is killed when it hangs past `timeout_s` (per variant), prints past `output_bytes`, answers past
`max_message` bytes or out of turn, and then this case and the remaining ones fail with the reason -- once a
hidden test has started, one reason whatever happened (HIDDEN_LOSS).
"""
from __future__ import annotations

import socket
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from labkit.course.exercises import wire
from labkit.course.exercises.cases import Case, CaseResult
from labkit.course.exercises.process import Launched, exit_reason, launch
from labkit.course.exercises.student import Student, StudentGone, grader_seconds, waiting
from labkit.course.exercises.verdicts import run_cases

_POLL_S = 0.1
#: Seconds a student's process gets to exit by itself after its channel closed, before it is killed.
_BYE_S = 5.0
#: Seconds the student's process may take to start (our code only: Python, labkit, the sandbox) before the
#: exercise's own clock starts; a busy machine must not eat a student's time.
STARTUP_S = 180.0
#: The one reason a lost process gets once a hidden test has sent it anything (issue #39): died, hung, printed
#: or answered too much, broke the channel -- the same words, so the kind of loss cannot encode a hidden input.
HIDDEN_LOSS = ("the exercise's process stopped during a hidden test (it died, ran out of memory or past its "
               "time, printed or returned too much); killed: run the visible tests (ex.check) and look for a crash, "
               "an endless loop or a rank that waits for a collective that never comes")


@dataclass(frozen=True)
class VariantResult:
    """The outcome of every case on one source variant."""

    results: tuple[CaseResult, ...]
    error: str = ""
    """Why tests could not run normally: the cell did not load, or the process hung / died / printed too much."""
    kind: str = ""
    """"" (ran), "cell" (the cell failed to load) or "process" (the process was lost)."""


class Channel:
    """The student's process and the socket to it."""

    def __init__(self, *, timeout_s: float, memory_bytes: int, output_bytes: int, isolation=None,
                 private: tuple = (), kernel: str = "labkit", max_message: int = wire.MAX_BYTES,
                 warm: tuple[str, ...] | None = None):
        """`warm` (not None): the tests spawn ranks; the process imports torch and starts its forkserver, which
        also imports the modules `warm` names (the tests' `imports=`), before it is ready."""
        self.timeout_s, self.output_bytes, self.max_message = timeout_s, output_bytes, max_message
        self.reveal = True
        """Name what the student's side controls (its output, exit code, sizes) in a reason: only until a
        hidden test has sent it anything, so no hidden input can come back that way."""
        self._tmp = tempfile.TemporaryDirectory(prefix="labkit-exercise-")
        ours, theirs = socket.socketpair()
        extra = ["--channel-fd", str(theirs.fileno()), *([] if warm is None else ["--warm", ",".join(warm)])]
        try:
            self.launched: Launched = launch(
                "labkit.course.exercises.server", Path(self._tmp.name), extra=extra,
                pass_fds=(theirs.fileno(),), memory_bytes=memory_bytes, output_bytes=output_bytes,
                isolation=isolation, private=private, kernel=kernel)
        finally:
            theirs.close()
        self.sock, self.seq, self._ready, self._starting, self.closed = ours, 0, False, False, False

    def close(self) -> None:
        """End the process (it exits by itself between requests, else it is killed) and reap it; once."""
        import subprocess

        from labkit.course.grading.confine import kill_process_tree

        if self.closed:
            return
        self.closed = True
        proc = self.launched.proc
        self.sock.close()  # end of requests: a process between requests kills its forkserver and exits (os._exit)
        try:
            proc.wait(timeout=_BYE_S)
        except subprocess.TimeoutExpired:  # busy in student code, or ignores the end: killed with its tree
            pass
        if proc.poll() is None:
            kill_process_tree(proc.pid)
        proc.wait()
        self.launched.box.close()
        self.launched.output.join()
        self._tmp.cleanup()

    # ------------------------------------------------------------ one exchange
    def wait_ready(self) -> None:
        """Wait for the process's first frame, sent before any student code runs (StudentGone otherwise)."""
        if self.seq == 0 and not self._ready:
            self._starting = True
            try:
                self._answer(time.monotonic() + STARTUP_S)
            finally:
                self._starting = False
            self._ready = True

    def exchange(self, request: dict, deadline: float) -> object:
        """Send `request`, return the decoded answer; StudentGone when the process is lost (then it is killed)."""
        import cloudpickle

        self.wait_ready()
        self.seq += 1
        payload = cloudpickle.dumps({**request, "seq": self.seq})
        try:
            self._send(struct.pack(">Q", len(payload)) + payload, deadline)
        except StudentGone:
            self.close_quietly()
            raise
        return self._answer(deadline)

    def _answer(self, deadline: float) -> object:
        try:
            (size,) = struct.unpack(">Q", self._recv(8, deadline))
            if size > self.max_message:
                said = f" of {size / 2**20:.1f} MiB" if self.reveal else ""
                raise StudentGone(f"announced an answer{said} above the {self.max_message / 2**20:g} MiB cap; killed "
                                  "(return smaller results)")
            data = self._recv(size, deadline)
        except StudentGone:
            self.close_quietly()
            raise
        try:
            answer = wire.decode(data, max_bytes=self.max_message)
        except wire.WireError as exc:
            return {"kind": "unreadable", "why": str(exc)}
        if type(answer) is not dict or answer.get("seq") != self.seq or type(answer.get("seq")) is not int:
            self.close_quietly()
            raise StudentGone("the exercise's process answered out of turn on its channel; killed")
        return answer

    def close_quietly(self) -> None:
        from labkit.course.grading.confine import kill_process_tree

        if self.launched.proc.poll() is None:
            kill_process_tree(self.launched.proc.pid)

    def _lost(self, deadline: float) -> None:
        """StudentGone when the process hung, printed too much or died."""
        out, proc = self.launched.output, self.launched.proc
        if out.over:
            raise StudentGone(f"printed more than {self.output_bytes / 2**20:g} MiB; killed (print less)")
        if time.monotonic() > deadline and self._starting:
            raise StudentGone(f"the exercise's process did not start within {STARTUP_S:g} s (a very busy machine?)")
        if time.monotonic() > deadline:
            raise StudentGone(f"still running after {self.timeout_s:g} s; killed (an endless loop, or a rank "
                              "waiting for a collective that never comes?)")
        if proc.poll() is not None:
            self.launched.output.join(1.0)
            capped = self.launched.box.exceeded()  # a cap of the grader's: named whatever the student's side sent
            tail = out.last_lines() if self.reveal and not capped else ""
            how = f" ({capped or exit_reason(proc)})" if self.reveal or capped else ""
            raise StudentGone(f"the exercise's process died{how} before answering" + (f": {tail}" if tail else ""))

    def _send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            self._lost(deadline)
            self.sock.settimeout(_POLL_S)
            try:
                view = view[self.sock.send(view[:2**20]):]
            except socket.timeout:
                continue
            except OSError as exc:
                self._lost(float("inf"))
                raise StudentGone(f"the exercise's channel broke ({exc.strerror}); killed") from None

    def _recv(self, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            self._lost(deadline)
            self.sock.settimeout(_POLL_S)
            try:
                chunk = self.sock.recv(min(n - len(buf), 2**20))
            except socket.timeout:
                continue
            except OSError:
                chunk = b""
            if not chunk:  # closed: the process died (or closed its end on purpose)
                time.sleep(_POLL_S)
                self._lost(float("inf"))
                raise StudentGone("the exercise's process closed its channel before answering; killed")
            buf += chunk
        return bytes(buf)


class RemoteStudent(Student):
    """A Student whose code runs in a Channel's process."""

    def __init__(self, exercise: str, channel: Channel, deadline: float):
        super().__init__(exercise)
        self.channel, self.deadline = channel, deadline
        self.gone: str = ""
        self.grader_s0 = grader_seconds()  # the grader's own time from here on extends the deadline

    def load(self, source: str) -> str:
        """Load an exercise cell on the student's side: "" when it defines the function, else why not."""
        answer = self._exchange({"op": "load", "exercise": self.exercise, "source": source})
        if type(answer) is dict and answer.get("kind") == "value":
            return ""
        message = answer.get("message") if type(answer) is dict else None
        return str(message)[:300] if message else "the exercise cell could not be loaded"

    def _ask(self, request: dict, label: str, returns):
        try:
            return super()._ask(request, label, returns)
        except StudentGone:
            if self.channel.reveal:
                raise
            self.gone = HIDDEN_LOSS  # whatever happened, in the same words (HIDDEN_LOSS)
            raise StudentGone(HIDDEN_LOSS) from None

    def _exchange(self, request: dict) -> object:
        if self.gone:
            raise StudentGone(self.gone)
        try:
            with waiting():  # other submissions' tests run while this one waits for the student's process
                return self.channel.exchange(request, self.deadline + grader_seconds() - self.grader_s0)
        except StudentGone as exc:
            self.gone = str(exc)
            raise


def judge(exercise: str, sources: list[str], cases: list[Case], *, timeout_s: float, memory_bytes: int,
          output_bytes: int, isolation=None, private: tuple = (), kernel: str = "labkit",
          max_message: int = wire.MAX_BYTES, cache: dict | None = None,
          warm: tuple[str, ...] | None = None, channel: Channel | None = None) -> list[VariantResult]:
    """Run `cases` (visible first) on each source variant; one VariantResult per variant, never raises for
    what the student's code does. A lost process's output and exit code are named only while no hidden case
    has sent it anything. `cache`: the references of this run (student.reference), kept for the caller.
    `channel`: a process the caller started ahead with these options (`open_channel`); judged and closed here."""
    cases = sorted(cases, key=lambda c: c.hidden)
    options = dict(timeout_s=timeout_s, memory_bytes=memory_bytes, output_bytes=output_bytes, isolation=isolation,
                   private=private, kernel=kernel, max_message=max_message, warm=warm)
    cache = {} if cache is None else cache
    out = []
    try:
        for source in sources:
            channel = channel or Channel(**options)
            student = RemoteStudent(exercise, channel, 0.0)
            try:
                channel.wait_ready()
                student.deadline = time.monotonic() + timeout_s
                error, kind = student.load(source), "cell"
            except StudentGone as exc:
                error, kind = str(exc), "process"
                student.gone = error
            if error:
                out.append(VariantResult(tuple(CaseResult(c, "fail", error) for c in cases), error, kind))
            else:
                channel.reveal = True
                results = run_cases(None, cases, student=student, cache=cache,
                                    before=lambda case: setattr(channel, "reveal", channel.reveal and not case.hidden))
                out.append(VariantResult(tuple(results), student.gone, "process" if student.gone else ""))
            if student.gone:
                channel.close()
                channel = None
    finally:
        if channel is not None:
            channel.close()
    return out
