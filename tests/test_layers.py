"""The package's layers (docs/DEVELOPING.md): the teaching core never imports the course machinery,
the drawings or the command line, and no two modules import each other round a circle.

Read from the source with `ast`, so an import inside a function counts as much as one at the top:
a lazy import is still an arrow a newcomer has to follow.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "labkit"
#: the folders that are layers above the core; everything else under labkit/ is the core
UPPER = ("course", "viz", "cli")


def module_files() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        mods[".".join(parts)] = path
    return mods


MODULES = module_files()


def owner(name: str) -> str:
    """The labkit module that defines dotted `name` (a module, or an attribute of one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def arrows(mods=MODULES) -> dict[str, set[str]]:
    """module -> the labkit modules it imports (anywhere in its body)."""
    out = {}
    for name, path in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {owner(a.name) for a in node.names if a.name.startswith("labkit")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labkit"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(owner(full) if full in mods else owner(node.module))
        out[name] = targets - {name, "labkit", ""}
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    if module == "labkit.__main__":
        return "cli"
    if module == "labkit":
        # the package root wires the layers together: it registers the course's seal on
        # `labkit.results`' publish hook (lazily), so the core itself never imports the course
        return "root"
    return parts[1] if len(parts) > 1 and parts[1] in UPPER else "core"


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(root):
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]; counter[0] += 1
        stack.append(root); on.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]; counter[0] += 1
                    stack.append(nxt); on.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop(); on.discard(m); comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_core_never_imports_course_viz_or_cli():
    bad = sorted(f"{a} -> {b}" for a, targets in arrows().items() for b in targets
                 if layer(a) == "core" and layer(b) in UPPER)
    assert bad == [], "the core must not import these layers (publish through a hook instead):\n" + "\n".join(bad)


def test_there_are_no_import_circles():
    assert circles(arrows()) == []


def test_the_checks_can_fail():
    """The two checks above see a forbidden arrow and a circle when there is one."""
    graph = {"labkit.results": {"labkit.course.grading.fingerprint"},
             "labkit.course.grading.fingerprint": {"labkit.results"}}
    assert circles(graph) == [["labkit.course.grading.fingerprint", "labkit.results"]]
    assert layer("labkit.results") == "core" and layer("labkit.course.grading.fingerprint") == "course"
    assert layer("labkit.viz.figures") == "viz" and layer("labkit.__main__") == "cli"
    assert layer("labkit.parallel.ddp") == "core" and layer("labkit") == "root"


@pytest.mark.parametrize("folder", ["viz", "profiling", "course"])
def test_each_layer_is_a_folder_that_says_what_it_is(folder):
    init = PKG / folder / "__init__.py"
    assert init.is_file() and ast.get_docstring(ast.parse(init.read_text())), f"labkit/{folder} needs a docstring"


def test_no_flat_module_is_left_where_a_layer_now_lives():
    moved = ["figures", "plots", "schedule_plot", "widgets", "trace_analysis", "oom", "slides",
             "notebooks", "lease_plan", "planner", "grading", "reserve"]
    assert [m for m in moved if (PKG / f"{m}.py").exists() or (PKG / m).is_dir()] == []


def test_the_ground_floor_stays_small_and_grouped():
    """A newcomer meets at most 12 flat modules; the rest live in packages named for what they are."""
    flat = sorted(p.name for p in PKG.glob("*.py"))
    assert len(flat) <= 12, flat
    for folder in ("runtime", "zoo"):
        init = PKG / folder / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"labkit/{folder} needs a docstring"


def test_nothing_in_labkit_exists_only_for_the_test_suite():
    """The suite's warm starts live in tests/support; labkit holds one seam for them (labkit.runtime.hooks)
    and names none of their modules or switches."""
    assert not [p for p in PKG.rglob("*.py") if p.stem in ("rank_zygote", "warm_kernels", "forking")]
    named = [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py") if p.name != "hooks.py" and any(word in p.read_text() for word in ("warmstart", "rank_zygote", "LABKIT_WARM_KERNELS", "LABKIT_RANK_ZYGOTE"))]
    assert named == [], named


#: STYLE.md rule 13: modules well under 400 lines. A module over it holds two things; split it by what they are.
LINE_LIMIT = 400


def too_long(mods: dict[str, Path], limit: int = LINE_LIMIT) -> list[str]:
    """'module: N lines' for each module of `mods` longer than `limit` lines, longest first."""
    counts = {name: len(path.read_text().splitlines()) for name, path in mods.items()}
    return [f"{name}: {n} lines" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]) if n > limit]


def test_every_module_stays_within_the_line_limit():
    over = too_long(MODULES)
    assert over == [], (f"over {LINE_LIMIT} lines (STYLE.md 13); move a group of functions that belong together "
                        "to a sibling module named for what it holds:\n" + "\n".join(over))


def test_the_line_limit_can_fail(tmp_path):
    sizes = {"labkit.short": 12, "labkit.at_limit": LINE_LIMIT, "labkit.over": LINE_LIMIT + 1}
    mods = {}
    for name, n in sizes.items():
        mods[name] = tmp_path / f"{name}.py"
        mods[name].write_text("x = 1\n" * n)
    assert too_long(mods) == [f"labkit.over: {LINE_LIMIT + 1} lines"]
