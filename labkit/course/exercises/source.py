"""Exercise cells of a notebook and their solution regions: find, validate, stub (`labkit assign`, grading).

An exercise cell has cell metadata `{"labkit": {"exercise": "<id>"}}` (or, when a student's Jupyter lost it,
a first line `# EXERCISE <id>: ...`) and defines `def <id>(...)`. Solution code sits between
`# BEGIN SOLUTION` and `# END SOLUTION` lines inside a function body; `labkit assign` replaces each region by
`raise NotImplementedError("exercise <id>: ...")` at the region's indent. In any code cell, a one-line
answer `name = <expr>  # SOLUTION` becomes `name = None  # YOUR ANSWER` (otter-assign's convention).
"""
from __future__ import annotations

import ast
import re

from labkit.errors import GradingError

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
_HEADER = re.compile(r"#\s*EXERCISE\s+([A-Za-z_]\w*)")
ONE_LINE_ANSWER = re.compile(r"^(\s*)([A-Za-z_][\w.\[\]\"']*)\s*=\s*.+?\s*#\s*SOLUTION\s*$")


class MarkerError(GradingError):
    """Solution markers that `labkit assign` cannot stub safely (the message names cell and line)."""


def exercise_id(cell) -> str | None:
    """The exercise id of a code cell: its metadata, else its `# EXERCISE <id>` first line, else None."""
    if cell.get("cell_type") != "code":
        return None
    meta = (cell.get("metadata") or {}).get("labkit") or {}
    if isinstance(meta, dict) and isinstance(meta.get("exercise"), str):
        return meta["exercise"]
    lines = cell.get("source", "").lstrip().splitlines()
    match = _HEADER.match(lines[0]) if lines else None
    return match.group(1) if match else None


def exercise_cells(nb) -> dict[str, str]:
    """{exercise id: cell source} in notebook order (the first cell wins when an id repeats)."""
    out: dict[str, str] = {}
    for cell in nb.cells:
        ex_id = exercise_id(cell)
        if ex_id and ex_id not in out:
            out[ex_id] = cell.source
    return out


def to_python(source: str) -> str:
    """Cell source as plain Python: IPython magics (`%time`, `!ls`, `%%writefile`) transformed as IPython does."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


def _marker(line: str) -> str | None:
    text = line.strip()
    return "begin" if text == BEGIN else "end" if text == END else None


def regions(source: str, where: str = "cell") -> list[tuple[int, int]]:
    """(begin, end) line indices of every solution region; MarkerError for unbalanced or nested markers,
    or a marker outside a function body."""
    lines, out, start = source.splitlines(), [], None
    for i, line in enumerate(lines):
        kind = _marker(line)
        if kind == "begin":
            if start is not None:
                raise MarkerError(f"{where}, line {i + 1}: {BEGIN} inside the region opened on line {start + 1}; "
                                  f"close it with {END} first")
            start = i
        elif kind == "end":
            if start is None:
                raise MarkerError(f"{where}, line {i + 1}: {END} without a {BEGIN} above it")
            out.append((start, i))
            start = None
    if start is not None:
        raise MarkerError(f"{where}, line {start + 1}: {BEGIN} is never closed; add {END}")
    if out:
        _inside_functions(source, out, where)
    return out


def _inside_functions(source: str, found: list[tuple[int, int]], where: str) -> None:
    try:
        tree = ast.parse(to_python(source))
    except SyntaxError as exc:
        raise MarkerError(f"{where}: the cell is not valid Python ({exc.msg}, line {exc.lineno})") from exc
    lines = source.splitlines()
    indent = [len(line) - len(line.lstrip()) for line in lines]
    defs = [(node.lineno, node.end_lineno, node.col_offset) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for begin, end in found:
        # A region starts after a `def` line, within its body, and both markers are indented under the def.
        if not any(first < begin + 1 <= last and min(indent[begin], indent[end]) > col
                   for first, last, col in defs):
            raise MarkerError(f"{where}, line {begin + 1}: a solution region must sit inside a function body "
                              "(the release replaces it by `raise NotImplementedError`, which must not run at import)")


def stub(source: str, exercise: str | None, where: str = "cell") -> str:
    """`source` with every solution region replaced by a NotImplementedError stub at the region's indent."""
    found = regions(source, where)
    lines = source.splitlines()
    name = exercise or "this function"
    for begin, end in reversed(found):
        indent = re.match(r"\s*", lines[begin]).group(0)
        raise_line = f'{indent}raise NotImplementedError("exercise {name}: write your code here")'
        lines[begin:end + 1] = [raise_line]
    out = "\n".join(_answer_stub(line) for line in lines)
    return out + ("\n" if source.endswith("\n") else "")


def _answer_stub(line: str) -> str:
    match = ONE_LINE_ANSWER.match(line)
    return f"{match.group(1)}{match.group(2)} = None  # YOUR ANSWER" if match else line


def solution_lines(source: str) -> list[str]:
    """The lines `stub` removes (what must not appear in a release)."""
    lines, out = source.splitlines(), []
    for begin, end in regions(source):
        out += [line for line in lines[begin + 1:end] if line.strip()]
    return out + [line for line in lines if ONE_LINE_ANSWER.match(line)]


_LOAD_SAFE_DECORATORS = {"staticmethod", "classmethod", "property"}


def _literal(node) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _plain_name(node) -> bool:
    """A name, a dotted name, a literal, or a subscript / union / tuple of those (an annotation, a default)."""
    if node is None or _literal(node) or isinstance(node, ast.Name):
        return True
    if isinstance(node, ast.Attribute):
        return _plain_name(node.value)
    if isinstance(node, ast.Subscript):
        return _plain_name(node.value) and _plain_name(node.slice)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _plain_name(node.left) and _plain_name(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Pow, ast.Mult)):  # 2**20, 4 * 2**10: small ints
        sides = (node.left, node.right)
        return all(isinstance(x, ast.Constant) and type(x.value) is int and 0 <= x.value <= 64 for x in sides) or \
            (isinstance(node.op, ast.Mult) and all(_plain_name(x) for x in sides))
    return isinstance(node, ast.Tuple) and all(_plain_name(e) for e in node.elts)


def _after_docstring(body: list) -> list:
    """`body` without its docstring (a leading string constant), if it has one."""
    return body[1:] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else body


def _raises_not_implemented(body: list) -> bool:
    """The body's first statement after a docstring is `raise NotImplementedError(...)` (the rest never runs)."""
    body = _after_docstring(body)
    if not body or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def _inert(node) -> bool:
    """Loading `node` runs no code of the student's: imports of installed modules, literal constants, plain
    definitions (their bodies run only when called)."""
    import importlib.util

    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
        return all(n and not getattr(node, "level", 0) and importlib.util.find_spec(n.split(".")[0]) is not None
                   for n in names)
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Constant)
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        return node.value is not None and _literal(node.value)
    decorators = all(isinstance(d, ast.Name) and d.id in _LOAD_SAFE_DECORATORS
                     for d in getattr(node, "decorator_list", ()))
    if isinstance(node, ast.ClassDef):
        return (decorators and not node.keywords and all(_plain_name(b) for b in node.bases)
                and all(_inert(n) for n in node.body))
    if isinstance(node, ast.FunctionDef):
        a = node.args
        annotations = [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x]
        return decorators and all(_plain_name(x) for x in (*a.defaults, *a.kw_defaults, *annotations, node.returns))
    return isinstance(node, ast.Pass)


def untouched_stub(source: str, exercise: str) -> bool:
    """True when the cell is still the release's stub of `exercise`: its function starts with (a docstring and)
    `raise NotImplementedError(...)`, and loading the cell runs nothing but imports of installed modules,
    literal constants and definitions. Such a cell is 'not attempted' without starting a process for it
    (issue #39: `labkit check` on a fresh notebook)."""
    try:
        tree = ast.parse(to_python(source))
    except SyntaxError:
        return False
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == exercise]
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    return (len(fns) == 1 and (_raises_not_implemented(fns[0].body) or _builds_stub_class(fns[0], classes))
            and all(_inert(n) for n in tree.body))


def _builds_stub_class(fn: ast.FunctionDef, classes: dict) -> bool:
    """`fn` (after a docstring) only returns `C(its own parameters)`, where C is a class of the cell whose
    `__init__` raises NotImplementedError first, after at most `super().__init__()` (06's `lora_linear` wraps
    the student's `LoRALinear`): calling it runs nothing of the student's before that raise."""
    body = _after_docstring(fn.body)
    if len(body) != 1 or not isinstance(body[0], ast.Return) or not isinstance(body[0].value, ast.Call):
        return False
    call, params = body[0].value, {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
    cls = classes.get(call.func.id) if isinstance(call.func, ast.Name) else None
    if cls is None or not all(isinstance(a, ast.Name) and a.id in params
                              for a in (*call.args, *(k.value for k in call.keywords))):
        return False
    inits = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    if len(inits) != 1:
        return False
    init = _after_docstring(inits[0].body)
    if init and ast.dump(init[0]) == ast.dump(ast.parse("super().__init__()").body[0]):
        init = init[1:]
    return _raises_not_implemented(init)
