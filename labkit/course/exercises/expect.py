"""`returns=` specs: the exact shape of what a student's code must give back (issue #26).

A spec is written like the value it describes, and checked strictly on the decoded plain data
(labkit.course.exercises.wire), before any comparison:

    int, bool, str, None      exactly that type (`type(x) is int`: a bool or a float is not an int)
    float                     an int or a float (not a bool); returned as a float
    [spec]                    a list (or tuple) whose every item matches spec; returned as a list
    (spec_a, spec_b)          a tuple (or list) of exactly that length, item by item; returned as a tuple
    {"key": spec, ...}        a dict with exactly these keys
    {str: spec}               a dict with str keys, any number of them
    Tensor(dtype, shape)      a torch.Tensor of that dtype and shape (None, or a None dimension: any)
    spec_a | spec_b           either (e.g. `int | None`)
    ANY                       any plain value (check it yourself)

A mismatch raises `ReturnTypeError` (an AssertionError: the test fails) naming what came back and what
was expected, e.g. "model_state_bytes(7000000000, 'mixed-bf16', 'adamw', 0, 1) returned a float
(1.12e+11); it must return an int".
"""
from __future__ import annotations

import types
import typing

from labkit.course.exercises.wire import Unsupported


class ReturnTypeError(AssertionError):
    """What came back is not what the exercise must return."""


class _Any:
    def __repr__(self) -> str:
        return "ANY"


ANY = _Any()


class Tensor:
    """Spec of a torch.Tensor: `Tensor("float32", (4, 8))`, `Tensor(torch.bfloat16)`, `Tensor(shape=(None, 3))`."""

    def __init__(self, dtype=None, shape=None):
        self.dtype = None if dtype is None else str(dtype).removeprefix("torch.")
        self.shape = None if shape is None else tuple(shape)

    def __repr__(self) -> str:
        return f"Tensor({self.dtype or 'any dtype'}, {self.shape if self.shape is not None else 'any shape'})"


def describe(value) -> str:
    """A short description of a decoded value for a message: its type and, when small, the value."""
    if isinstance(value, Unsupported):
        return f"a {value.type_name} object"
    if value is None:
        return "None"
    kind = type(value).__name__
    if type(value) is float:
        return f"a float ({value:.4g})"
    if type(value) in (bool, int):
        return f"{'an' if kind == 'int' else 'a'} {kind} ({value})"
    if type(value) is str:
        return f"a str ({value[:40]!r}{'...' if len(value) > 40 else ''})"
    if type(value) in (list, tuple, dict):
        return f"a {kind} of {len(value)}"
    if kind == "Tensor":
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    return f"a {kind}"


def _spec_name(spec) -> str:
    if spec is None:
        return "None"
    if isinstance(spec, type):
        return {"int": "an int", "float": "a number (int or float)"}.get(spec.__name__, f"a {spec.__name__}")
    if type(spec) is list:
        return f"a list of {_spec_name(spec[0])}"
    if type(spec) is tuple:
        return f"a tuple of {len(spec)} ({', '.join(_spec_name(s) for s in spec)})"
    if type(spec) is dict:
        keys = [k for k in spec if type(k) is str]
        return f"a dict with keys {keys}" if keys else f"a dict of {_spec_name(spec[str])}"
    return repr(spec)


def conform(value, spec, what: str):
    """`value` checked against `spec` (see the module docstring); ReturnTypeError names `what` otherwise."""
    try:
        return _conform(value, spec)
    except _Mismatch as exc:
        where = f"{exc.path}: " if exc.path else ""
        raise ReturnTypeError(f"{what} returned {where}{describe(exc.value)}; it must be {_spec_name(exc.spec)}"
                              + exc.extra) from None


class _Mismatch(Exception):
    def __init__(self, value, spec, path: str = "", extra: str = ""):
        super().__init__()
        self.value, self.spec, self.path, self.extra = value, spec, path, extra


def _conform(value, spec):
    if spec is ANY:
        return value
    if spec is None:
        if value is None:
            return None
        raise _Mismatch(value, spec)
    if isinstance(spec, (types.UnionType,)) or typing.get_origin(spec) is typing.Union:
        for option in typing.get_args(spec):
            try:
                return _conform(value, None if option is type(None) else option)
            except _Mismatch:
                continue
        raise _Mismatch(value, spec)
    if spec is float:
        if type(value) in (int, float):
            return float(value)
        raise _Mismatch(value, spec)
    if isinstance(spec, type) and spec in (int, bool, str):
        if type(value) is spec:
            return value
        raise _Mismatch(value, spec)
    if isinstance(spec, Tensor):
        return _tensor(value, spec)
    if type(spec) is list and len(spec) == 1:
        return _items(value, spec, [spec[0]] * len(value) if type(value) in (list, tuple) else [], list)
    if type(spec) is tuple:
        if type(value) in (list, tuple) and len(value) != len(spec):
            raise _Mismatch(value, spec, extra=f" (it has {len(value)} items)")
        return _items(value, spec, list(spec), tuple)
    if type(spec) is dict:
        return _dict(value, spec)
    raise TypeError(f"returns={spec!r} is not a spec (see labkit.course.exercises.expect)")


def _items(value, spec, specs: list, out_type):
    if type(value) not in (list, tuple):
        raise _Mismatch(value, spec)
    items = []
    for i, (item, item_spec) in enumerate(zip(value, specs)):
        try:
            items.append(_conform(item, item_spec))
        except _Mismatch as exc:
            exc.path = f"[{i}]" + exc.path
            raise
    return out_type(items)


def _dict(value, spec: dict):
    if type(value) is not dict:
        raise _Mismatch(value, spec)
    if set(spec) == {str}:
        specs = {k: spec[str] for k in value}
    else:
        missing, extra = [k for k in spec if k not in value], [k for k in value if k not in spec]
        if missing or extra:
            raise _Mismatch(value, spec, extra=(f" (missing {missing})" if missing else "") +
                            (f" (unexpected {extra[:5]})" if extra else ""))
        specs = spec
    out = {}
    for key, item_spec in specs.items():
        try:
            out[key] = _conform(value[key], item_spec)
        except _Mismatch as exc:
            exc.path = f"[{key!r}]" + exc.path
            raise
    return out


def _tensor(value, spec: Tensor):
    import sys

    torch = sys.modules.get("torch")
    if torch is None or type(value) is not torch.Tensor:
        raise _Mismatch(value, spec)
    dtype = str(value.dtype).removeprefix("torch.")
    if spec.dtype is not None and dtype != spec.dtype:
        raise _Mismatch(value, spec, extra=f" (dtype {dtype}, expected {spec.dtype})")
    shape = tuple(value.shape)
    if spec.shape is not None and (len(shape) != len(spec.shape) or
                                   any(w is not None and w != d for d, w in zip(shape, spec.shape))):
        raise _Mismatch(value, spec, extra=f" (shape {shape}, expected {spec.shape})")
    return value
