"""Plain data between a student's process and the grader: the only thing that crosses (issue #26).

`encode(value)` (run where student code runs) turns a value into bytes; `decode(data)` (run by the
grader) rebuilds it as plain Python: None, bool, int, float, str, list, tuple, dict with str keys, and
`torch.Tensor`s rebuilt from raw bytes. Nothing is unpickled, no student class is ever instantiated:
an object of any other type (an `int` subclass whose `__eq__` always says True, a `defaultdict`, a
numpy scalar, a DTensor) arrives as `Unsupported("<its type name>")`, which equals nothing, so a test's
type check names it. Every size is checked before it is read: the whole message (`max_bytes`), the JSON
header, the nesting depth, each tensor's bytes against its dtype and shape.

Layout: b"LKW1" + u32 header length + header JSON {"v": tree, "blobs": [n0, n1, ...]} + the blobs.
In the tree every JSON array is tagged: ["L", ...] list, ["T", ...] tuple, ["D", {key: node}] dict,
["X", blob, dtype, shape] tensor, ["?", type name] unsupported; JSON objects appear only inside "D".
"""
from __future__ import annotations

import json
import struct

MAGIC = b"LKW1"
#: Largest message the grader reads (tensors included); larger ones are refused unread.
MAX_BYTES = 128 * 2**20
#: Largest JSON header: numbers, strings and the tree's shape (tensors travel as raw bytes beside it).
MAX_HEADER = 4 * 2**20
MAX_DEPTH = 64
#: Characters of a student's string kept where it names a type or an error.
NAME_CHARS = 80
_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
           "complex64", "complex128")


class WireError(ValueError):
    """Bytes that are not a valid message (too large, malformed, inconsistent sizes)."""


class Unsupported:
    """Grader-side stand-in for a value of a type that does not cross: equal to nothing but itself."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str):
        self.type_name = str(type_name)[:NAME_CHARS]

    def __repr__(self) -> str:
        return f"<a {self.type_name} object>"


def type_name(value) -> str:
    cls = type(value)
    module = getattr(cls, "__module__", "") or ""
    name = getattr(cls, "__qualname__", "?")
    return (name if module in ("builtins", "__main__", "labkit_submission") else f"{module}.{name}")[:NAME_CHARS]


# ---------------------------------------------------------------- encode (wherever student code runs)
def encode(value) -> bytes:
    """`value` as bytes; never raises for what `value` is (unknown types become "?" nodes)."""
    blobs: list[bytes] = []
    tree = _node(value, blobs, 0)
    header = json.dumps({"v": tree, "blobs": [len(b) for b in blobs]}, allow_nan=True).encode()
    return b"".join([MAGIC, struct.pack(">I", len(header)), header, *blobs])


def _node(value, blobs: list, depth: int):
    if depth > MAX_DEPTH:
        return ["?", f"value nested deeper than {MAX_DEPTH}"]
    kind = type(value)
    if value is None or kind in (bool, float, str):
        return value
    if kind is int:
        return value if value.bit_length() < 4000 else ["?", "int with more than 1200 digits"]
    if kind in (list, tuple):
        return ["L" if kind is list else "T", *(_node(v, blobs, depth + 1) for v in value)]
    if kind is dict:
        if not all(type(k) is str for k in value):
            return ["?", "dict with non-str keys"]
        return ["D", {k: _node(v, blobs, depth + 1) for k, v in value.items()}]
    tensor = _tensor_node(value, blobs)
    return tensor if tensor is not None else ["?", type_name(value)]


def _tensor_node(value, blobs: list):
    import sys

    torch = sys.modules.get("torch")  # a tensor exists only if torch was imported
    if torch is None or type(value) not in (torch.Tensor, torch.nn.Parameter):
        return None
    dtype = str(value.dtype).removeprefix("torch.")
    if dtype not in _DTYPES or value.layout != torch.strided or value.is_quantized or value.device.type == "meta":
        return ["?", f"tensor of dtype {dtype} / layout {value.layout}"]
    flat = value.detach().resolve_conj().resolve_neg().to("cpu").contiguous().reshape(-1)
    blobs.append(flat.view(torch.uint8).numpy().tobytes())
    return ["X", len(blobs) - 1, dtype, list(value.shape)]


# ---------------------------------------------------------------- decode (the grader)
def decode(data: bytes, *, max_bytes: int = MAX_BYTES):
    """The plain value in `data`; WireError for anything malformed or over a cap."""
    if len(data) > max_bytes:
        raise WireError(f"a message of {len(data):,} B, above the {max_bytes:,} B cap")
    if len(data) < 8 or data[:4] != MAGIC:
        raise WireError("not a labkit message (bad magic)")
    (size,) = struct.unpack(">I", data[4:8])
    if size > min(MAX_HEADER, len(data) - 8):
        raise WireError(f"header of {size} bytes does not fit the message or the {MAX_HEADER} B cap")
    try:
        header = json.loads(data[8:8 + size])
    except (ValueError, RecursionError) as exc:
        raise WireError(f"header is not JSON ({type(exc).__name__})") from None
    if type(header) is not dict or set(header) != {"v", "blobs"} or type(header["blobs"]) is not list:
        raise WireError("header is not {v, blobs}")
    sizes = header["blobs"]
    if not all(type(n) is int and n >= 0 for n in sizes) or sum(sizes) != len(data) - 8 - size:
        raise WireError("blob sizes do not add up to the message")
    offsets, start = [], 8 + size
    for n in sizes:
        offsets.append((start, start + n))
        start += n
    used: set[int] = set()
    return _value(header["v"], data, offsets, used, 0)


def _value(node, data: bytes, offsets: list, used: set, depth: int):
    if depth > MAX_DEPTH:
        raise WireError(f"nested deeper than {MAX_DEPTH}")
    kind = type(node)
    if node is None or kind in (bool, int, float, str):
        return node
    if kind is not list or not node or type(node[0]) is not str:
        raise WireError("untagged node")
    tag, rest = node[0], node[1:]
    if tag in ("L", "T"):
        items = [_value(v, data, offsets, used, depth + 1) for v in rest]
        return items if tag == "L" else tuple(items)
    if tag == "D" and len(rest) == 1 and type(rest[0]) is dict:
        return {str(k): _value(v, data, offsets, used, depth + 1) for k, v in rest[0].items()}
    if tag == "X" and len(rest) == 3:
        return _tensor(rest, data, offsets, used)
    if tag == "?" and len(rest) == 1 and type(rest[0]) is str:
        return Unsupported(rest[0])
    raise WireError(f"unknown node tag {tag[:10]!r}")


def _tensor(rest: list, data: bytes, offsets: list, used: set):
    index, dtype, shape = rest
    if type(index) is not int or not 0 <= index < len(offsets) or index in used:
        raise WireError("tensor refers to a missing or reused blob")
    if dtype not in _DTYPES or type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise WireError("tensor with a bad dtype or shape")
    used.add(index)
    import torch

    torch_dtype = getattr(torch, dtype)
    numel = 1
    for d in shape:
        numel *= d
    start, end = offsets[index]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    if numel * itemsize != end - start:
        raise WireError(f"tensor of shape {shape} and dtype {dtype} with {end - start} bytes")
    if numel == 0:
        return torch.empty(shape, dtype=torch_dtype)
    raw = torch.frombuffer(bytearray(data[start:end]), dtype=torch.uint8)
    return raw.view(torch_dtype).reshape(shape)
