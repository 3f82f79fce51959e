"""Students that answer from a script, never from code: hollow answers and tricks for the exercise tests (issue #39).

`Scripted(exercise, answer)` is a Student whose every request is answered with `answer(request, returns)` (the
plain data a student's process could send back), through the same `settle` / `conform` as a real answer.
`hollow(spec, kind)` builds, from an exercise's `returns=` spec, the hollow answer of one kind: the empty
lists and dicts, zero-size tensors, None wherever the spec lets it, NaN, tensors of a broadcastable wrong shape.
`hollowed(value)` empties a real answer the way a dishonest student would (lists and dicts emptied, tensors
zero-size, numbers kept). tests/test_exercises_ci.py and tests/test_exercises_hollow.py use them; nothing in
labkit does.
"""
from __future__ import annotations

import types
import typing

from labkit.course.exercises.expect import ANY, Either, Float, List, Tensor
from labkit.course.exercises.student import Student

#: The kinds of hollow answer every test must fail (tests/test_exercises_ci.py).
KINDS = ("empty", "zero-size", "none", "nan", "wrong-shape")


class Scripted(Student):
    """A Student answered by `answer(request, returns) -> value` (see the module docstring)."""

    def __init__(self, exercise: str, answer):
        super().__init__(exercise)
        self.answer, self._returns = answer, ANY

    def call(self, *args, returns, **kwargs):
        self._returns = returns
        return super().call(*args, returns=returns, **kwargs)

    def run(self, harness, *args, returns, **kwargs):
        self._returns = returns
        return super().run(harness, *args, returns=returns, **kwargs)

    def spawn(self, harness, *, returns, **kwargs):
        self._returns = returns
        return super().spawn(harness, returns=returns, **kwargs)

    def _exchange(self, request: dict) -> object:
        return {"kind": "value", "value": self.answer(request, self._returns)}


def hollow_student(exercise: str, kind: str) -> Scripted:
    """The Student whose every answer is `hollow(returns, kind)` (one per rank for a spawn)."""
    def answer(request, returns):
        value = hollow(returns, kind)
        return [hollow(returns, kind) for _ in range(request["world"])] if request["op"] == "spawn" else value

    return Scripted(exercise, answer)


def _tensor(spec: Tensor, kind: str):
    import torch

    dtype = getattr(torch, spec.dtype or "float32")
    shape = tuple(1 if d is None else d for d in (spec.shape if spec.shape is not None else (3,)))
    if kind == "zero-size":
        return torch.zeros((0, *shape), dtype=dtype)
    if kind == "wrong-shape":  # broadcasts against the right one
        return torch.zeros((2, 1, *shape), dtype=dtype)
    if kind == "nan" and (dtype.is_floating_point or dtype.is_complex):
        return torch.full(shape, float("nan"), dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def _leaf(kind: str):
    """What a hollow answer puts where the spec takes anything (ANY)."""
    import torch

    return {"empty": [], "zero-size": torch.zeros(0), "none": None, "nan": float("nan"),
            "wrong-shape": torch.zeros(2, 1, 1)}[kind]


def hollow(spec, kind: str):
    """The hollow answer of `kind` (one of KINDS) shaped by `spec` (labkit.course.exercises.expect)."""
    if spec is ANY:
        return _leaf(kind)
    if spec is None:
        return None
    options = (spec.options if isinstance(spec, Either) else typing.get_args(spec)
               if isinstance(spec, types.UnionType) or typing.get_origin(spec) is typing.Union else None)
    if options is not None:
        if kind == "none" and any(o is None or o is type(None) for o in options):
            return None
        return hollow(next(o for o in options if o is not None and o is not type(None)), kind)
    if spec is float or isinstance(spec, Float):
        return float("nan") if kind == "nan" else 0.0
    if spec is int:
        return 0
    if spec is bool:
        return False
    if spec is str:
        return ""
    if isinstance(spec, Tensor):
        return _tensor(spec, kind)
    if type(spec) is list or isinstance(spec, List):
        item = spec[0] if type(spec) is list else spec.item
        count = 1 if type(spec) is list else spec.length if spec.length is not None else max(spec.min, 1)
        return [] if kind == "empty" else [hollow(item, kind) for _ in range(count)]
    if type(spec) is tuple:
        return () if kind == "empty" else tuple(hollow(s, kind) for s in spec)
    if type(spec) is dict:
        if set(spec) == {str}:
            return {} if kind == "empty" else {"hollow": hollow(spec[str], kind)}
        return {k: hollow(v, kind) for k, v in spec.items()}
    raise TypeError(f"no hollow answer for the spec {spec!r}")


def hollowed(value):
    """`value` emptied as a dishonest student would: lists and dicts emptied, tensors zero-size, the rest kept.
    A dict with fixed keys keeps them (a spec would refuse it otherwise); its values are hollowed."""
    import torch

    if isinstance(value, torch.Tensor):
        return torch.zeros((0, *value.shape), dtype=value.dtype)
    if type(value) in (list, tuple):
        return []
    if type(value) is dict:
        return {k: hollowed(v) for k, v in value.items()}
    return value
