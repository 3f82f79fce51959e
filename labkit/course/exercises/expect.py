"""`returns=` specs: the exact shape of what a student's code must give back (issue #26).

A spec is written like the value it describes, and checked strictly on the decoded plain data
(labkit.course.exercises.wire), before any comparison:

    int, bool, str, None      exactly that type (`type(x) is int`: a bool or a float is not an int)
    float                     an int or a float (not a bool); returned as a float
    [spec]                    a list (or tuple) of any length (empty too) whose every item matches spec
    List(spec, n)             a list (or tuple) of exactly n items (List(spec, min=1): at least one); a list
    (spec_a, spec_b)          a tuple (or list) of exactly that length, item by item; returned as a tuple
    {"key": spec, ...}        a dict with exactly these keys
    {str: spec}               a dict with str keys, any number of them
    Tensor(dtype, shape)      a torch.Tensor of that dtype and shape (None, or a None dimension: any); never
                              zero-size unless the shape says 0, never NaN/inf unless finite=False
    spec_a | spec_b           either (e.g. `int | None`); Either(spec_a, spec_b) when a spec is not a type
    Float(finite=False)       a float that may be NaN or inf (an overflowed loss)
    ANY                       any plain value (check it yourself)

A float must be finite too (NaN and inf are never an answer). `ANY` is for values a test only reads for a
hint; a value worth points has a spec.

A mismatch raises `ReturnTypeError` (an AssertionError: the test fails) naming what came back and what
was expected, e.g. "model_state_bytes(7000000000, 'mixed-bf16', 'adamw', 0, 1) returned a float
(1.12e+11); it must return an int".

Comparing with the reference (issue #39): `close(got, want)` is torch.allclose that never broadcasts (a shape,
dtype, length or key that differs is "not close", before any arithmetic), `like(got, want, what)` raises
ReturnTypeError naming the first difference, and `pairs(got, want, what)` is zip that refuses unequal lengths.
Tests compare through these, so a hollow answer (an empty list, a zero-size tensor, None, NaN, a wrong shape)
fails the check it reaches and costs the grader no more than the reference's own size.
"""
from __future__ import annotations

import math
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

    def __init__(self, dtype=None, shape=None, *, finite: bool = True):
        self.dtype = None if dtype is None else str(dtype).removeprefix("torch.")
        self.shape = None if shape is None else tuple(shape)
        self.finite = finite

    def __repr__(self) -> str:
        return f"Tensor({self.dtype or 'any dtype'}, {self.shape if self.shape is not None else 'any shape'})"


class List:
    """Spec of a list of exactly `length` items (`List(spec, 3)`), or of at least `min` (`List(spec, min=1)`)."""

    def __init__(self, item, length: int | None = None, *, min: int = 0):  # noqa: A002 - reads as the spec
        self.item, self.length, self.min = item, length, min

    def __repr__(self) -> str:
        count = self.length if self.length is not None else f"min={self.min}"
        return f"List({self.item!r}, {count})"


class Float:
    """Spec of a number, like `float`; `Float(finite=False)` also takes NaN and inf."""

    def __init__(self, *, finite: bool = True):
        self.finite = finite

    def __repr__(self) -> str:
        return "a number (int or float)" if self.finite else "a number (NaN and inf too)"


class Either:
    """Spec of a value matching any of `options` (`Either(Float(finite=False), None)`)."""

    def __init__(self, *options):
        self.options = options

    def __repr__(self) -> str:
        return " or ".join(_spec_name(o) for o in self.options)


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
    if isinstance(spec, List):
        count = f"{spec.length}" if spec.length is not None else f"at least {spec.min}"
        return f"a list of {count} ({_spec_name(spec.item)})"
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
    if isinstance(spec, (types.UnionType, Either)) or typing.get_origin(spec) is typing.Union:
        for option in spec.options if isinstance(spec, Either) else typing.get_args(spec):
            try:
                return _conform(value, None if option is type(None) else option)
            except _Mismatch:
                continue
        raise _Mismatch(value, spec)
    if spec is float or isinstance(spec, Float):
        if type(value) in (int, float) and (math.isfinite(value) or isinstance(spec, Float) and not spec.finite):
            return float(value)
        raise _Mismatch(value, spec, extra=" (NaN or inf)" if type(value) is float else "")
    if isinstance(spec, type) and spec in (int, bool, str):
        if type(value) is spec:
            return value
        raise _Mismatch(value, spec)
    if isinstance(spec, Tensor):
        return _tensor(value, spec)
    if type(spec) is list and len(spec) == 1:
        return _items(value, spec, [spec[0]] * len(value) if type(value) in (list, tuple) else [], list)
    if isinstance(spec, List):
        if type(value) in (list, tuple) and (len(value) != spec.length if spec.length is not None
                                             else len(value) < spec.min):
            raise _Mismatch(value, spec, extra=f" (it has {len(value)} items)")
        return _items(value, spec, [spec.item] * len(value) if type(value) in (list, tuple) else [], list)
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
    if value.numel() == 0 and not (spec.shape is not None and 0 in spec.shape):
        raise _Mismatch(value, spec, extra=f" (shape {shape} holds no element)")
    if spec.finite and (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all()):
        raise _Mismatch(value, spec, extra=" (it holds NaN or inf)")
    return value


# ---------------------------------------------------------------- comparing with the reference (issue #39)
def difference(got, want, path: str = "") -> str:
    """'' when `got` has the structure of `want` (type, tensor shape and dtype, list length, dict keys), else
    the first difference, e.g. "['weights']: 0 items, expected 3". Reads sizes only: no arithmetic."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(want, torch.Tensor):
        if type(got) is not torch.Tensor:
            return f"{path or 'it'} is {describe(got)}, expected a tensor of shape {tuple(want.shape)}"
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            return f"{path or 'it'} is {describe(got)}, expected {describe(want)[2:]}"
        return ""
    if isinstance(want, (list, tuple)):
        if type(got) not in (list, tuple):
            return f"{path or 'it'} is {describe(got)}, expected a list of {len(want)}"
        if len(got) != len(want):
            return f"{path or 'it'} has {len(got)} items, expected {len(want)}"
        return next((d for i, (g, w) in enumerate(zip(got, want)) if (d := difference(g, w, f"{path}[{i}]"))), "")
    if isinstance(want, dict):
        if type(got) is not dict:
            return f"{path or 'it'} is {describe(got)}, expected a dict with keys {sorted(want, key=str)[:5]}"
        if set(got) != set(want):
            missing, extra = sorted(set(want) - set(got), key=str), sorted(set(got) - set(want), key=str)
            return f"{path or 'it'}: keys missing {missing[:5]}, unexpected {extra[:5]}"
        return next((d for k in want if (d := difference(got[k], want[k], f"{path}[{k!r}]"))), "")
    if want is None:
        return "" if got is None else f"{path or 'it'} is {describe(got)}, expected None"
    if type(want) in (int, float) and type(want) is not bool:
        ok = type(got) in (int, float) and math.isfinite(got)
        return "" if ok else f"{path or 'it'} is {describe(got)}, expected a finite number"
    return "" if type(got) is type(want) else f"{path or 'it'} is {describe(got)}, expected {describe(want)}"


def like(got, want, what: str):
    """`got`, after ReturnTypeError unless it has the structure of `want` (see `difference`)."""
    problem = difference(got, want)
    if problem:
        raise ReturnTypeError(f"{what}: {problem}")
    return got


def close(got, want, *, rtol: float = 1e-5, atol: float = 1e-8) -> bool:
    """torch.allclose (math.isclose for numbers, == for the rest) over `want`'s whole structure, and False
    when the structure differs: no broadcasting, no arithmetic on a size the student chose."""
    import sys

    if difference(got, want):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(want, torch.Tensor):
        if not (want.is_floating_point() or want.is_complex()):
            return bool(torch.equal(got, want))
        return bool(torch.isfinite(got).all()) and bool(torch.allclose(got, want, rtol=rtol, atol=atol))
    if isinstance(want, (list, tuple)):
        return all(close(g, w, rtol=rtol, atol=atol) for g, w in zip(got, want))
    if isinstance(want, dict):
        return all(close(got[k], want[k], rtol=rtol, atol=atol) for k in want)
    if type(want) in (int, float) and type(want) is not bool:
        return abs(got - want) <= atol + rtol * abs(want)
    return got == want


def max_error(got, want) -> float:
    """The largest |got - want| of two tensors of one shape (inf when the shapes differ: never broadcast)."""
    if difference(got, want):
        return float("inf")
    return float((got.double() - want.double()).abs().max()) if got.numel() else 0.0


def pairs(got, want, what: str) -> list[tuple]:
    """zip(got, want), after ReturnTypeError unless both are lists of one length."""
    if type(got) not in (list, tuple) or type(want) not in (list, tuple) or len(got) != len(want):
        raise ReturnTypeError(f"{what}: {describe(got)}, expected {len(want)} items")
    return list(zip(got, want))
