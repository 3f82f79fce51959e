"""How long `labkit check` takes on a lab with nothing attempted, and on the whole lab solved (issue #39).

    .venv/bin/python bench/check_speed.py [NOTEBOOK ...]     (default: 01_memory 03_ddp)

For each course notebook: its exercise cells stubbed as `labkit assign` ships them (nothing attempted), then
the source notebook itself (every exercise written: the visible tests of every exercise run). The notebook
is not executed (its recorded checks read whatever it holds): this times what `labkit check` adds, the code
tests. Wall and CPU seconds (this process and its children). Targets on an idle 2-core machine: under 5 s
with nothing attempted, under 20 s for a whole lab. A bench, not a test: it measures, it asserts nothing.

Where a whole lab's seconds went, and what took them out (docs/DEVELOPING.md, "Seventh round"): each
exercise's process exited through the interpreter's teardown with torch imported, and stopped its forkserver
the same way (~2 s per exercise; now it kills the forkserver and exits at once); reading the notebook imported
jsonschema's IRI grammar (~1 s; now loaded on first use); each process imported torch and started its forkserver
only when its turn came (now the next one is started, and readies itself, while the current one runs).
"""
from __future__ import annotations

import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _timed(path: Path, name: str) -> tuple[float, float, str]:
    from labkit.cli.check import check_notebook

    wall, cpu = time.monotonic(), _cpu()
    report = check_notebook(path, name, tests=ROOT / "notebooks" / "tests")
    states = ", ".join(f"{g.exercise} {g.status}" for g in report.code)
    return time.monotonic() - wall, _cpu() - cpu, states


def _cli(path: Path, name: str) -> float:
    """Wall seconds of the whole `labkit check` command (a fresh Python: labkit's import included)."""
    import subprocess

    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import sys; from labkit.cli import cli; sys.argv[0] = 'labkit'; cli()",
                    "check", str(path), "--as", name, "--tests", str(ROOT / "notebooks" / "tests")],
                   capture_output=True, check=False)
    return time.monotonic() - started


def main(names: list[str]) -> None:
    from labkit.course.exercises.source import exercise_id, stub
    from labkit.course.grading.evaluate import import_nbformat

    nbformat = import_nbformat()  # as `labkit check` imports it

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{'notebook':<28} {'case':<18} {'wall s':>7} {'cpu s':>7}  exercises")
    with tempfile.TemporaryDirectory(prefix="labkit-check-bench-") as tmp:
        for name in names:
            source = ROOT / "notebooks" / f"{name}.ipynb"
            nb = nbformat.read(source, 4)
            for cell in nb.cells:
                ex = exercise_id(cell)
                if ex:
                    cell.source = stub(cell.source, ex)
            blank = Path(tmp) / f"{name}.ipynb"
            nbformat.write(nb, blank)
            print(f"{name:<28} {'the CLI, untouched':<18} {_cli(blank, name):7.1f} {'':>7}  (a fresh process)",
                  flush=True)
            for case, path in (("nothing attempted", blank), ("whole lab solved", source)):
                wall, cpu, states = _timed(path, name)
                print(f"{name:<28} {case:<18} {wall:7.1f} {cpu:7.1f}  {states}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["01_memory", "03_ddp"])
