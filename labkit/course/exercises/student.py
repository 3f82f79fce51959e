"""The student's code as a test sees it: `student.call`, `student.run`, `student.spawn` (issue #26).

A test (`@case("<id>", points=N) def test(student): ...`) never holds the student's function. It holds a
`Student`, which runs that function where student code runs and brings back plain data only
(labkit.course.exercises.wire), checked against the `returns=` spec (labkit.course.exercises.expect):

    student.call(*args, returns=int, **kwargs)                -> <id>(*args, **kwargs)
    student.run(harness, *args, returns=spec, **kwargs)       -> harness(<id>, *args, **kwargs), one process
    student.spawn(harness, world=3, args=(...), returns=spec) -> [harness(rank, world, <id>, *args) per rank]
    with student.raises(ValueError): student.call(...)        -> the student's code must raise ValueError

The arguments travel to the student's side as copies (pickled by the grader: models, optimizers, tensors
are fine); a harness runs there too, so it must never compute an expected value: student code in that
process can read its frames or patch torch. Expected values come from the test itself, from
`reference(fn, *args)` (computed in the grader's process) or `trusted_spawn(harness, world, args)` (fresh
ranks that never load student code); both are cached across a grading run's variants (the CI's mutants).

Two kinds of Student: `LocalStudent` (the function is in this process: `ex.check` in the student's own
notebook, where the student's process is its own grader) and `labkit.course.exercises.judge.RemoteStudent`
(a channel to a sandboxed process: `labkit check` and `labkit grade`). Both take the same path
(labkit.course.exercises.server.perform, then wire encode/decode), so a test gives the same verdict and
message in the notebook, in `labkit check` and in `labkit grade`.
"""
from __future__ import annotations

import copy
import hashlib
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable

from labkit.course.exercises import wire
from labkit.course.exercises.expect import ANY, ReturnTypeError, conform

#: Characters kept of a message that came from student code (an exception's text).
MESSAGE_CHARS = 500
#: Seconds a `student.spawn` / `trusted_spawn` may run unless the test says otherwise.
SPAWN_TIMEOUT_S = 120.0


class StudentError(Exception):
    """The student's code raised (in its own process, or on a rank): fails the test with this message."""

    def __init__(self, label: str, kind: str, message: str, rank: int | None = None):
        self.label, self.kind, self.message, self.rank = label, kind, message, rank
        text = f"{label}: {message}" if kind == "ExerciseError" else f"{label} raised {kind}: {message}"
        super().__init__(text.rstrip(": "))


class NotAttempted(Exception):
    """The release's stub answered (NotImplementedError): the test is 'not attempted'."""


class StudentGone(Exception):
    """The student's process died, hung past its time, printed past its cap or broke the channel: this test
    and every remaining one fail with this reason."""


class Student:
    """What a test calls; see the module docstring."""

    def __init__(self, exercise: str):
        self.exercise = exercise
        self._last_label = exercise
        self._runs: dict = {}

    # ------------------------------------------------------------ the API of test authors
    def call(self, *args, returns, **kwargs):
        """`<id>(*args, **kwargs)` on the student's side; its return value checked against `returns`."""
        label = f"{self.exercise}({brief_args(args, kwargs)})"
        return self._ask({"op": "call", "args": args, "kwargs": kwargs}, label, returns)

    def run(self, harness: Callable, *args, returns, **kwargs):
        """`harness(<id>, *args, **kwargs)` in one process on the student's side (rich objects: train a model
        with the student's step, return the losses). The harness returns plain data; it never computes an
        expected value."""
        label = f"{self.exercise} in {getattr(harness, '__name__', 'harness')}({brief_args(args, kwargs)})"
        return self._ask({"op": "run", "harness": harness, "args": args, "kwargs": kwargs}, label, returns)

    def spawn(self, harness: Callable, *, world: int = 2, args: tuple = (), returns,
              timeout: float = SPAWN_TIMEOUT_S, share: bool = False, imports: tuple[str, ...] = ()) -> list:
        """`harness(rank, world, <id>, *args)` on `world` gloo ranks on the student's side; the per-rank
        return values, each checked against `returns`. `share=True`: the tests of this student that spawn
        the same (harness, world, args) share one run (its values, or what it raised), so one spawn serves
        several tests, each worth its own points. `imports`: heavy modules the harness imports (say
        "transformers.models.llama.modeling_llama": seconds per rank); warm ranks fork with them imported."""
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise ValueError(f"spawn world={world!r}; it must be a positive integer")
        label = f"{self.exercise} on {world} ranks in {getattr(harness, '__name__', 'harness')}"
        request = {"op": "spawn", "harness": harness, "world": world, "args": tuple(args), "timeout": float(timeout)}
        if imports:
            request["imports"] = tuple(str(m) for m in imports)
        values = self._shared(request, label) if share else self._ask(request, label, [ANY])
        if len(values) != world:
            raise ReturnTypeError(f"{label} returned {len(values)} results for {world} ranks")
        return [conform(v, returns, f"{label}: rank {r}") for r, v in enumerate(values)]

    @contextmanager
    def raises(self, *kinds):
        """The student's code inside the block must raise one of `kinds` (classes or names)."""
        names = tuple(k if isinstance(k, str) else k.__name__ for k in kinds)
        try:
            yield
        except StudentError as exc:
            if exc.kind in names:
                return
            raise AssertionError(f"{exc.label} raised {exc.kind} ({exc.message[:200]}); it must raise "
                                 f"{' or '.join(names)}") from None
        raise AssertionError(f"{self._last_label} returned normally; it must raise {' or '.join(names)}")

    # ------------------------------------------------------------ the mechanics
    def _shared(self, request: dict, label: str) -> list:
        """`_ask(request)` once per identical request of this student; later asks get a copy of its outcome."""
        key = request_key(request)
        if key is None:
            return self._ask(request, label, [ANY])
        if key not in self._runs:
            try:
                self._runs[key] = (True, self._ask(request, label, [ANY]))
            except (StudentError, NotAttempted, ReturnTypeError) as exc:
                self._runs[key] = (False, exc)
        ok, outcome = self._runs[key]
        if not ok:
            raise outcome
        return copy.deepcopy(outcome)

    def _ask(self, request: dict, label: str, returns):
        self._last_label = label
        return settle(self._exchange(request), label, returns)

    def _exchange(self, request: dict) -> object:
        """The decoded envelope the student's side answered `request` with."""
        raise NotImplementedError


class LocalStudent(Student):
    """The student's function in this process (the notebook's `ex.check`)."""

    def __init__(self, fn: Callable, exercise: str | None = None):
        super().__init__(exercise or getattr(fn, "__name__", "exercise"))
        self.fn = fn

    def _exchange(self, request: dict) -> object:
        import cloudpickle

        from labkit.course.exercises.server import perform

        request = cloudpickle.loads(cloudpickle.dumps(request))  # the copies a sandboxed process would get
        with waiting():
            data = wire.encode(perform(self.fn, request, reraise=(KeyboardInterrupt,)))
        try:
            return wire.decode(data)
        except wire.WireError as exc:
            return {"kind": "unreadable", "why": str(exc)}


def settle(envelope, label: str, returns):
    """The value in a decoded envelope, checked; StudentError / NotAttempted for the student's exceptions."""
    if type(envelope) is not dict or type(envelope.get("kind")) is not str:
        raise StudentGone(f"{label}: the student's process answered with something that is not an answer")
    kind = envelope["kind"]
    if kind == "value" and "value" in envelope:
        return conform(envelope["value"], returns, label)
    if kind == "unreadable":
        raise ReturnTypeError(f"{label} returned a value the grader cannot read ({str(envelope.get('why'))[:200]}); "
                              "return plain data: numbers, strings, lists, dicts, tensors")
    if kind == "error":
        text = lambda key, n: str(envelope.get(key, ""))[:n]  # noqa: E731
        rank = envelope.get("rank")
        if envelope.get("not_attempted") is True:
            raise NotAttempted(text("message", MESSAGE_CHARS))
        raise StudentError(label, text("type", wire.NAME_CHARS), text("message", MESSAGE_CHARS),
                           rank if type(rank) is int else None)
    raise StudentGone(f"{label}: the student's process answered with an unknown kind of answer")


def brief(value) -> str:
    """A short, safe description of a test's argument for a label: numbers and strings as repr, else a type."""
    if value is None or type(value) in (bool, int, float):
        return repr(value)
    if type(value) is str:
        return repr(value) if len(value) <= 30 else repr(value[:27] + "...")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return f"<{str(value.dtype).removeprefix('torch.')} tensor {tuple(value.shape)}>"
    if type(value) in (list, tuple) and len(value) <= 4 and all(type(v) in (int, float, str) for v in value):
        return repr(value)
    return f"<{type(value).__name__}>"


def brief_args(args: tuple, kwargs: dict) -> str:
    text = ", ".join([brief(a) for a in args] + [f"{k}={brief(v)}" for k, v in kwargs.items()])
    return text if len(text) <= 160 else text[:157] + "..."


# ---------------------------------------------------------------- references (the grader's side)
_JUDGE = threading.Lock()
_local = threading.local()


@contextmanager
def judging(cache: dict | None):
    """Run one test under the grader's lock, with `cache` for its references (one per exercise run).

    Tests of several submissions run in threads of one grader (`labkit grade --workers`); the lock makes
    a test's use of torch's global RNG (`torch.manual_seed` then `torch.randn`) its own. While a test waits
    for a process (the student's, trusted ranks) the lock is released and its RNG state kept, so other
    submissions' tests run meanwhile and this one continues exactly where it was."""
    with _JUDGE:
        _local.holding, _local.cache = True, cache
        try:
            yield
        finally:
            _local.holding, _local.cache = False, None


def _rng_state():
    import random

    state = {"random": random.getstate()}
    if "torch" in sys.modules:
        state["torch"] = sys.modules["torch"].get_rng_state()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def _set_rng_state(state) -> None:
    import random

    random.setstate(state["random"])
    if "torch" in state:
        sys.modules["torch"].set_rng_state(state["torch"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


@contextmanager
def waiting():
    """Release the grader's lock while this thread waits on another process (see `judging`)."""
    if not getattr(_local, "holding", False):
        yield
        return
    saved, cache = _rng_state(), _local.cache
    _local.holding = False
    _JUDGE.release()
    try:
        yield
    finally:
        started = time.monotonic()
        _JUDGE.acquire()  # waiting for other submissions' tests: not the student's time (grader_seconds)
        _local.grader_s = grader_seconds() + time.monotonic() - started
        _local.holding, _local.cache = True, cache
        _set_rng_state(saved)


def request_key(value) -> str | None:
    """A digest of a (picklable) request or reference call, or None when it does not pickle."""
    try:
        import cloudpickle

        return hashlib.sha256(cloudpickle.dumps(value)).hexdigest()
    except Exception:  # noqa: BLE001 - an argument that does not pickle: no key
        return None


def grader_seconds() -> float:
    """Seconds this thread has spent on the grader's own work (references, trusted spawns, waiting for the
    grader's lock) since it started: a student's deadline is extended by these, so a slow reference
    never uses up the time the student's code is given (judge.RemoteStudent)."""
    return getattr(_local, "grader_s", 0.0)


def _timed(compute: Callable):
    started = time.monotonic()
    try:
        return compute()
    finally:
        _local.grader_s = grader_seconds() + time.monotonic() - started


def _cached(kind: str, fn: Callable, args: tuple, kwargs: dict, compute: Callable):
    cache = getattr(_local, "cache", None)
    if cache is None:
        return _timed(compute)
    digest = request_key((fn, args, sorted(kwargs.items())))
    if digest is None:
        return _timed(compute)
    key = (kind, digest)
    if key not in cache:
        cache[key] = _timed(compute)
    return copy.deepcopy(cache[key])


def reference(fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)` computed in the grader's process (never where student code runs), cached for
    the variants of one grading run: `fn` must be deterministic (seed inside it)."""
    _no_student(args, kwargs, "reference")
    return _cached("reference", fn, args, kwargs, lambda: fn(*args, **kwargs))


def trusted_spawn(harness: Callable, *, world: int = 2, args: tuple = (), timeout: float = SPAWN_TIMEOUT_S) -> list:
    """`harness(rank, world, *args)` on `world` fresh gloo ranks that never load student code: the multi-rank
    reference (DDP, all_reduce, DTensor's plans). Cached like `reference`; returns the per-rank values."""
    from labkit.course.exercises.spawn import spawn

    _no_student(args, {}, "trusted_spawn")

    def compute():
        with waiting():
            return spawn(harness, world=world, args=tuple(args), timeout=timeout)

    return _cached("trusted_spawn", harness, (world, *args), {}, compute)


def _no_student(args: tuple, kwargs: dict, what: str) -> None:
    if any(isinstance(a, Student) for a in (*args, *kwargs.values())):
        raise TypeError(f"{what}(...) got the student's code; references never run it (use student.run / spawn)")
