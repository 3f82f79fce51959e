"""Declared checks: points, visible or hidden, and a function over an executed notebook's `Evidence`.

Kinds (one factory each): `cell_ran` (a cell ran without error), `answer_close` (an answer within
tolerance of a reference labkit computes), `answer_equals`, `relation` with `peak_below`,
`speedup_at_least` and `fits_in` (measured relations between recorded runs), `figure_present`, `manual`
(a free-text answer a TA marks: labkit.course.grading.manual).
A check function returns (passed, message) or raises `CheckFailed(message)`; the message is shown to
students for visible checks only (a hidden check's message may name expected values).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Union

from labkit.errors import ConfigError
from labkit.course.grading.evidence import CheckFailed, Evidence, cell_number, code_cells, error_of
from labkit.course.grading.factors import factor_hint

Outcome = tuple[bool, str]
Number = Union[float, Callable[[Evidence], float]]


@dataclass(frozen=True)
class CheckResult:
    name: str
    points: float
    earned: float
    passed: bool
    visible: bool
    message: str
    todo: bool = False
    """Not answered yet (the release's `None`): TODO, not FAIL (issue #39)."""


@dataclass(frozen=True)
class Check:
    """One graded check of one course notebook."""

    name: str
    """Shown to students, also for hidden checks: never put expected values in it."""
    points: float
    fn: Callable[[Evidence], Outcome]
    kind: str = "custom"
    visible: bool = True
    """Hidden checks run only in `labkit grade`; feedback names them and says pass/fail, nothing more."""
    reads: tuple[tuple[str, str], ...] = ()
    """(kind, key) of the recorded answers/runs it reads: tests check that the notebook records them."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("a Check needs a non-empty name")
        if not (isinstance(self.points, (int, float)) and self.points > 0):
            raise ConfigError(f"check {self.name!r}: points={self.points!r}; give a positive number")

    def run(self, evidence: Evidence) -> CheckResult:
        """Evaluate on `evidence`; a crash inside the check is a failed check, never a crashed batch."""
        todo = False
        try:
            passed, message = self.fn(evidence)
        except Unanswered as exc:
            passed, message, todo = False, str(exc), True
        except CheckFailed as exc:
            passed, message = False, str(exc)
        except Exception as exc:  # noqa: BLE001 - submissions hold anything; report, don't die
            passed, message = False, f"could not evaluate ({type(exc).__name__}: {exc})"[:400]
        passed = bool(passed)
        return CheckResult(self.name, float(self.points), float(self.points) if passed else 0.0,
                           passed, self.visible, str(message), todo)


class Unanswered(CheckFailed):
    """The answer is still the release's None: the check is TODO, not failed."""


def answered(ev: Evidence, key: str):
    """ev.answer(key), after Unanswered (a TODO) when it is still None."""
    value = ev.answer(key)
    if value is None:
        raise Unanswered(f"answer {key!r} is not written yet: replace the None in the cell that records it "
                         f"(R.answer({key!r}, ...)) with your answer and run it")
    return value


def _value(ref: Number, ev: Evidence) -> float:
    return float(ref(ev) if callable(ref) else ref)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CheckFailed(f"{what} is {value!r}; record a finite number")
    return float(value)


# ---------------------------------------------------------------- the cell ran without error
def cell_ran(name: str, points: float, *, tag: str | None = None, key: str | None = None,
             kind: str = "answer", visible: bool = True) -> Check:
    """The cells tagged `tag`, or the cell that recorded `key`, or (neither given) every code cell ran
    (has an execution count) and shows no error output."""
    def fn(ev: Evidence) -> Outcome:
        if tag is not None:
            cells = ev.tagged(tag)
            if not cells:
                raise CheckFailed(f"no cell tagged {tag!r}; restore the cell from the course notebook")
        elif key is not None:
            cells = [ev.cell_of(kind, key)]
        else:
            cells = [i for i, _ in code_cells(ev.nb)]
        for i in cells:
            cell = ev.nb.cells[i]
            if cell.get("execution_count") is None:
                return False, f"cell {cell_number(ev.nb, i)} never ran; run it (Run > Run All Cells) and save"
            err = error_of(cell)
            if err:
                return False, f"cell {cell_number(ev.nb, i)} raised {err}; fix it and re-run"
        return True, f"{len(cells)} cell(s) ran without error"
    return Check(name, points, fn, "cell_ran", visible, ((kind, key),) if key else ())


# ---------------------------------------------------------------- answers
def answer_close(name: str, points: float, key: str, reference: Number, *, rtol: float = 0.05,
                 atol: float = 0.0, visible: bool = True) -> Check:
    """answer(key) is within atol + rtol*|reference|; `reference` may be a function of the evidence
    (computed by labkit at grading time, e.g. `labkit.memory.estimate` for the profile's model).
    A visible check never prints the reference (`labkit check` would hand out the answer); a hidden
    one's message, which only the instructor sees, does."""
    def fn(ev: Evidence) -> Outcome:
        got = _number(answered(ev, key), f"answer {key!r}")
        ref = _value(reference, ev)
        ok = abs(got - ref) <= atol + rtol * abs(ref)
        rel = f"within {rtol:.0%}" if atol == 0 else f"within {rtol:.0%} + {atol:g}"
        if ok:
            return True, f"answer {key!r} = {got:g} is {rel} of labkit's value"
        shown = "" if visible else f" {ref:g}"
        hint = factor_hint(got, ref)  # a known factor off (N, (N-1)/N, 2, 4, GB vs GiB): say which
        return False, (f"answer {key!r} = {got:g} is not {rel} of labkit's value{shown}; "
                       + (hint if hint else "recheck the calculation"))
    return Check(name, points, fn, "answer_close", visible, (("answer", key),))


def answer_equals(name: str, points: float, key: str, expected: Any, *, visible: bool = True) -> Check:
    """answer(key) == expected (a value, or a function of the evidence; strings compared case- and
    space-insensitively)."""
    norm = (lambda v: " ".join(v.lower().split()) if isinstance(v, str) else v)  # noqa: E731

    def fn(ev: Evidence) -> Outcome:
        got = answered(ev, key)
        if norm(got) == norm(expected(ev) if callable(expected) else expected):
            return True, f"answer {key!r} = {got!r} is right"
        return False, f"answer {key!r} = {got!r} is not the expected answer; revisit the exercise"
    return Check(name, points, fn, "answer_equals", visible, (("answer", key),))


# ---------------------------------------------------------------- graded by a TA
AWAITING = "awaiting a TA's mark"


def manual(name: str, points: float, key: str, *, visible: bool = True) -> Check:
    """A free-text answer (`answer(key, "...")`) that a TA grades (labkit.course.grading.manual: `labkit grade
    review OUT_DIR`); until marked it earns 0 and says it awaits a mark."""
    def fn(ev: Evidence) -> Outcome:
        text = ev.answer(key)
        if not isinstance(text, str) or not text.strip():
            return False, f"answer {key!r} is empty; write your answer as text and record it with answer({key!r}, ...)"
        return False, AWAITING
    return Check(name, points, fn, "manual", visible, (("answer", key),))


# ---------------------------------------------------------------- measured relations
def relation(name: str, points: float, predicate: Callable[[Evidence], Outcome | bool], *,
             visible: bool = True, reads: tuple[tuple[str, str], ...] = ()) -> Check:
    """A measured relation over recorded runs/answers; `predicate` returns bool or (bool, message)."""
    def fn(ev: Evidence) -> Outcome:
        out = predicate(ev)
        return out if isinstance(out, tuple) else (bool(out), "holds" if out else "does not hold")
    return Check(name, points, fn, "relation", visible, reads)


def losses_agree(key: str, base: str, rtol: float | dict[str, float]):
    """Predicate: run `key` has `base`'s losses step for step (sharding moves bytes, not the math).
    `rtol` is one tolerance, or one per dtype of run `key` ({"float32": 1e-3, "bfloat16": 0.02, ...}):
    16-bit runs round differently under another schedule or sharding."""
    def pred(ev: Evidence):
        run = ev.run(key)
        a, b = run.losses, ev.run(base).losses
        if not a or len(a) != len(b):
            return False, f"{key} has {len(a)} losses, {base} {len(b)}; run both with the same steps"
        tol = rtol.get(run.dtype, min(rtol.values())) if isinstance(rtol, dict) else rtol
        worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
        return worst <= tol, f"{key} vs {base}: largest relative loss difference {worst:.2e} (allowed {tol:g})"
    return pred


def bytes_below(field: str, key: str, base: str):
    """Predicate: max per-rank `<field>_bytes` of run `key` < that of run `base`."""
    def pred(ev: Evidence):
        a, b = (max(getattr(ev.run(k), f"{field}_bytes") or [0]) for k in (key, base))
        return a < b, f"{key} {field} bytes/rank {a:,} {'<' if a < b else '>='} {base}'s {b:,}"
    return pred


def _peak(ev: Evidence, key: str) -> int:
    peaks = ev.run(key).peak_bytes
    if not peaks:
        raise CheckFailed(f"run {key!r} has no peak_bytes")
    return max(peaks)


def peak_below(name: str, points: float, key: str, other: str, *, visible: bool = True) -> Check:
    """max per-rank peak of run `key` < that of run `other` (e.g. FSDP below DDP)."""
    def pred(ev: Evidence) -> Outcome:
        a, b = _peak(ev, key), _peak(ev, other)
        verdict = "below" if a < b else "not below"
        return a < b, f"{key} peak {a / 2**20:.1f} MiB/rank is {verdict} {other} peak {b / 2**20:.1f} MiB/rank"
    return relation(name, points, pred, visible=visible, reads=(("run", key), ("run", other)))


def speedup_at_least(name: str, points: float, fast: str, base: str, floor: Number, *,
                     metric: str = "samples_per_s", visible: bool = True) -> Check:
    """run(fast).metric / run(base).metric >= floor (a number or a function of the evidence, so a
    floor can depend on the profile: CPU smoke runs do not speed up)."""
    def pred(ev: Evidence) -> Outcome:
        f, b = getattr(ev.run(fast), metric), getattr(ev.run(base), metric)
        if not b or b <= 0:
            raise CheckFailed(f"run {base!r} has {metric}={b!r}; it must be > 0")
        speedup, need = f / b, _value(floor, ev)
        ok = speedup >= need
        return ok, f"{fast} vs {base}: {metric} speedup {speedup:.2f}x ({'>=' if ok else '<'} {need:g}x)"
    return relation(name, points, pred, visible=visible, reads=(("run", fast), ("run", base)))


def fits_in(name: str, points: float, key: str, limit_gib: Number, *, visible: bool = True) -> Check:
    """max per-rank peak of run `key` <= limit_gib GiB (e.g. QLoRA of a 7B model on a 24 GB card)."""
    def pred(ev: Evidence) -> Outcome:
        peak, limit = _peak(ev, key), _value(limit_gib, ev)
        ok = peak <= limit * 2**30
        return ok, f"{key} peak {peak / 2**30:.2f} GiB/rank {'fits in' if ok else 'exceeds'} {limit:g} GiB"
    return relation(name, points, pred, visible=visible, reads=(("run", key),))


# ---------------------------------------------------------------- figures
def figure_present(name: str, points: float, *, tag: str | None = None, visible: bool = True) -> Check:
    """An image output (png/svg/jpeg) in the cells tagged `tag`, or anywhere if no tag is given."""
    def fn(ev: Evidence) -> Outcome:
        cells = None
        if tag is not None:
            cells = ev.tagged(tag)
            if not cells:
                raise CheckFailed(f"no cell tagged {tag!r}; restore the cell from the course notebook")
        if ev.has_image(cells):
            return True, "figure present"
        where = f"the cell tagged {tag!r}" if tag else "the notebook"
        return False, f"no figure in {where}; run the plotting cell (display the figure) and save"
    return Check(name, points, fn, "figure_present", visible)
