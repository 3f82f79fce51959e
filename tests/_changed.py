"""`make test-changed`: run the tests that import what the working tree changed (docs/DEVELOPING.md, "The suite").

Changed = `git diff --name-only BASE` (BASE defaults to HEAD: what is not committed yet; `BASE=main` for a
whole branch) plus untracked files. A changed file selects:
- a test file (tests/test_*.py): itself;
- a labkit module: every test file that imports it or any labkit module that imports it, at any depth
  (imports read with `ast`, function-level ones too, as tests/test_layers.py reads them), and the
  notebooks that import one of those modules (their runs in tests/test_notebooks.py);
- a notebook, or its tests in notebooks/tests/: that notebook's runs and exercise tests;
- a test helper (tests/_*.py, tests/conftest.py): the test files that import it or name it;
- anything else (docs, data, Makefile, pyproject.toml): the test files that mention its file name.
Notebook-parametrized tests are narrowed with `--notebooks` (tests/conftest.py deselects the others).
`python tests/_changed.py [--base REF] [--list]` prints the selection; without --list it runs pytest on it,
passing any further arguments through.
"""
from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
PKG = ROOT / "labkit"
#: Test files whose tests are parametrized over notebooks: narrowed to the changed notebooks.
PER_NOTEBOOK = ("tests/test_notebooks.py", "tests/test_exercises_ci.py")


def changed_files(base: str = "HEAD") -> list[str]:
    def git(*args: str) -> list[str]:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return [line for line in out.splitlines() if line]

    return sorted(set(git("diff", "--name-only", base)) | set(git("ls-files", "--others", "--exclude-standard")))


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


_NAMED = re.compile(r"^(labkit(\.\w+)+(:\w+)?|_[a-z]\w*)$")


def _owner(name: str) -> str:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports_of(source: str, filename: str = "<source>") -> set[str]:
    """The labkit modules and test helpers (`_x`, `conftest`) that `source` imports anywhere in its body, or
    names in a string (a registry entry "labkit.parallel.zero:ZeroStrategy", a launched "-m" module)."""
    out = set()
    try:
        tree = ast.parse(source, filename)
    except SyntaxError:
        return out
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAMED.match(node.value):
            out.add(_owner(node.value.partition(":")[0]) if node.value.startswith("labkit") else node.value)
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from labkit.runtime import launch` imports the module labkit.runtime.launch; `from labkit.x import f` labkit.x
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("labkit"):
                out.add(_owner(name))
            elif name.split(".")[0].startswith("_") or name == "conftest":
                out.add(name.split(".")[0])
    return out - {""}


def _notebook_source(path: Path) -> str:
    import json

    cells = json.loads(path.read_text()).get("cells", [])
    # IPython magics are not Python: keep only the lines ast can read
    lines = [line for c in cells if c.get("cell_type") == "code" for line in "".join(c["source"]).splitlines()
             if not line.lstrip().startswith(("%", "!"))]
    return "\n".join(lines)


@functools.lru_cache(maxsize=1)
def _graph() -> dict[str, set[str]]:
    graph = {name: imports_of(path.read_text(), str(path)) for name, path in MODULES.items()}
    for name, path in MODULES.items():  # a registry that imports f"labkit.pkg.{name}" reaches all of pkg
        if f'f"{name}.{{' in path.read_text():
            graph[name] |= {m for m in MODULES if m.rpartition(".")[0] == name}
    return graph


def importers(changed_modules: set[str]) -> set[str]:
    """`changed_modules` and every labkit module that imports one of them, at any depth."""
    graph = _graph()
    found, grew = set(changed_modules), True
    while grew:
        grew = False
        for name, deps in graph.items():
            if name not in found and deps & found:
                found.add(name)
                grew = True
    return found


def select(changed: list[str]) -> tuple[list[str], set[str]]:
    """(test files to run, notebook stems to narrow the per-notebook tests to)."""
    tests = sorted(TESTS.glob("test_*.py"))
    texts = {p: p.read_text() for p in tests}
    uses = {p: imports_of(t, str(p)) for p, t in texts.items()}
    notebooks = {p.stem: p for p in sorted((ROOT / "notebooks").glob("*.ipynb")) +
                 sorted((ROOT / "reservations").glob("*.ipynb"))}
    chosen, stems, modules = set(), set(), set()
    for name in changed:
        path = ROOT / name
        if name.startswith("tests/test_") and name.endswith(".py"):
            chosen.add(path)
        elif name.startswith("labkit/") and name.endswith(".py"):
            modules.add(_module_name(path))
        elif name.endswith(".ipynb") and path.stem in notebooks:
            stems.add(path.stem)
        elif name.startswith("notebooks/tests/") and name.endswith(".py"):
            stems.add(path.stem)
        elif name.startswith("tests/") and name.endswith(".py"):  # a helper or conftest
            helper = path.stem
            chosen |= {p for p in tests if helper in uses[p]}
            if helper == "conftest":
                chosen |= set(tests)  # every test file gets its fixtures
        else:
            chosen |= {p for p in tests if path.name in texts[p]}
    if modules:
        affected = importers(modules)
        chosen |= {p for p in tests if uses[p] & affected}
        stems |= {stem for stem, nb in notebooks.items() if imports_of(_notebook_source(nb)) & affected}
    files = sorted(str(p.relative_to(ROOT)) for p in chosen)
    if stems:
        files = sorted(set(files) | set(PER_NOTEBOOK))
    elif chosen & {TESTS / "test_notebooks.py", TESTS / "test_exercises_ci.py"}:
        stems = set(notebooks)  # the per-notebook test file itself changed: all notebooks
    return files, stems


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="compare the working tree with this git ref (default HEAD)")
    parser.add_argument("--list", action="store_true", help="print the selection, run nothing")
    args, rest = parser.parse_known_args(argv)
    changed = changed_files(args.base)
    files, stems = select(changed)
    notebooks_arg = [f"--notebooks={','.join(sorted(stems))}"] if stems else []
    print(f"changed since {args.base}: {len(changed)} file(s); tests: {' '.join(files) or 'none'}"
          + (f"; notebooks: {', '.join(sorted(stems))}" if stems else ""))
    if args.list or not files:
        return 0
    rest = [a for a in rest if a != "--"]
    return subprocess.call([sys.executable, "-m", "pytest", *files, *notebooks_arg, *rest], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
