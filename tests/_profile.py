"""Where the suite's time goes, grouped by kind: `make test-profile` (docs/DEVELOPING.md, "The suite").

With `--kind-profile FILE` every test appends one JSON line to FILE (safe under pytest-xdist: each worker
appends whole lines): its wall seconds, the CPU seconds of pytest and of every process it started and
waited for (ranks, kernels, torchrun, sandboxes: RUSAGE_CHILDREN counts a whole waited-for tree), and
how many Python processes it started (sampled from /proc every 0.2 s, so a process that lives less
than that may be missed). At the end the table by kind is printed. Wall seconds depend on what else
the machine runs; CPU seconds hardly do, so a profile taken on a busy machine still shows the split.

`python tests/_profile.py FILE.jsonl|JUNIT.xml [--slow-ids FILE]` prints the same table again, also
from a JUnit XML (`pytest --junitxml`: wall seconds only; kinds that depend on the `slow` marker then
need `--slow-ids`, the output of `pytest --collect-only -q -m slow`).
"""
from __future__ import annotations

import json
import os
import re
import resource
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

#: (kind, rule) in order; the first rule that matches a test names its kind. A rule sees the node id,
#: whether the test is marked slow and how many Python processes it started (None when not sampled).
KINDS = [
    ("notebook: smoke", lambda n, slow, procs: "test_notebook_runs_in_smoke_profile" in n),
    ("notebook: rehearsals", lambda n, slow, procs: "rehears" in n),
    ("launcher load test", lambda n, slow, procs: n.startswith("tests/test_launch_load.py")),
    ("browser (chromium)", lambda n, slow, procs: n.startswith(("tests/test_widgets_browser.py", "tests/test_slides.py"))),
    ("sandbox grading", lambda n, slow, procs: n.startswith(("tests/test_grading_isolation.py",
                                                              "tests/test_grading_corpus.py",
                                                              "tests/test_grading_hostile.py"))),
    ("exercise spawns and mutants", lambda n, slow, procs: n.startswith("tests/test_exercises_") and
     (slow or bool(procs))),
    ("multi-process jobs (torchrun, spawn)", lambda n, slow, procs: slow),
    ("unmarked tests that start processes", lambda n, slow, procs: bool(procs)),
    ("pure Python", lambda n, slow, procs: True),
]


def kind_of(nodeid: str, slow: bool, procs: int | None) -> str:
    return next(name for name, rule in KINDS if rule(nodeid, slow, procs))


def _cpu() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


class _Sampler(threading.Thread):
    """Counts the distinct Python processes below this one while a test runs."""

    def __init__(self):
        super().__init__(daemon=True, name="kind-profile-sampler")
        self.seen: set[tuple[int, float]] = set()
        self.since = 0.0  # count only processes started after this (epoch seconds): not the session's own
        self.active = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        import psutil

        me = psutil.Process()
        while True:
            self.active.wait()
            try:
                kids = me.children(recursive=True)
            except psutil.Error:
                kids = []
            for child in kids:
                try:
                    if child.create_time() >= self.since and ("python" in child.name().lower() or
                                                              "python" in " ".join(child.cmdline()[:1]).lower()):
                        with self.lock:
                            self.seen.add((child.pid, child.create_time()))
                except psutil.Error:
                    pass
            time.sleep(0.2)

    def take(self) -> int:
        with self.lock:
            count, self.seen = len(self.seen), set()
        return count


class KindProfile:
    """The pytest plugin behind --kind-profile (registered by tests/conftest.py)."""

    def __init__(self, path: Path):
        self.path, self.started = path, time.monotonic()
        self.sampler, self.failed = _Sampler(), set()
        self.sampler.start()

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed.add(report.nodeid)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.sampler.take()
        self.sampler.since = time.time() - 0.05
        self.sampler.active.set()
        start, cpu0 = time.monotonic(), _cpu()
        yield
        cpu1 = _cpu()
        self.sampler.active.clear()
        row = {"nodeid": item.nodeid, "slow": item.get_closest_marker("slow") is not None,
               "wall": round(time.monotonic() - start, 3), "cpu_self": round(cpu1[0] - cpu0[0], 3),
               "cpu_children": round(cpu1[1] - cpu0[1], 3), "procs": self.sampler.take(),
               "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "failed": item.nodeid in self.failed}
        with open(self.path, "a") as fh:  # one write of one line: workers' lines never interleave
            fh.write(json.dumps(row) + "\n")

    def pytest_terminal_summary(self, terminalreporter):
        if os.environ.get("PYTEST_XDIST_WORKER") or not self.path.exists():
            return
        rows = load_rows(self.path)
        terminalreporter.write_sep("=", f"time by kind ({self.path})")
        terminalreporter.write_line(table(rows, time.monotonic() - self.started))
        terminalreporter.write_line("slowest tests:\n" + slowest(rows))


# ---------------------------------------------------------------- the table
def load_rows(path: Path, slow_ids: set[str] | None = None) -> list[dict]:
    """Rows from a --kind-profile file (JSON lines) or a JUnit XML (wall seconds only)."""
    if path.suffix == ".xml":
        import xml.etree.ElementTree as ET

        rows = []
        for case in ET.parse(path).iter("testcase"):
            file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
            nodeid = f"{file}::{case.get('name')}"
            rows.append({"nodeid": nodeid, "slow": nodeid in (slow_ids or set()), "wall": float(case.get("time", 0)),
                         "cpu_self": None, "cpu_children": None, "procs": None})
        return rows
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table(rows: list[dict], session_wall: float | None = None) -> str:
    """Tests, wall and CPU seconds and Python processes started, per kind, largest wall first."""
    agg = defaultdict(lambda: {"n": 0, "wall": 0.0, "cpu": 0.0, "procs": 0, "has_cpu": False})
    for row in rows:
        a = agg[kind_of(row["nodeid"], row["slow"], row.get("procs"))]
        a["n"] += 1
        a["wall"] += row["wall"]
        if row.get("cpu_self") is not None:
            a["has_cpu"] = True
            a["cpu"] += row["cpu_self"] + row["cpu_children"]
            a["procs"] += row.get("procs") or 0
    total_wall = sum(a["wall"] for a in agg.values()) or 1.0
    lines = [f"{'kind':<38} {'tests':>5} {'wall s':>8} {'wall %':>6} {'CPU s':>8} {'py procs':>8}"]
    for name, a in sorted(agg.items(), key=lambda kv: -kv[1]["wall"]):
        cpu = f"{a['cpu']:8.0f}" if a["has_cpu"] else f"{'-':>8}"
        procs = f"{a['procs']:8d}" if a["has_cpu"] else f"{'-':>8}"
        lines.append(f"{name:<38} {a['n']:5d} {a['wall']:8.0f} {100 * a['wall'] / total_wall:6.1f} {cpu} {procs}")
    cpu_total = sum(a["cpu"] for a in agg.values())
    lines.append(f"{'all tests':<38} {sum(a['n'] for a in agg.values()):5d} {total_wall:8.0f} {100.0:6.1f} "
                 f"{cpu_total:8.0f} {sum(a['procs'] for a in agg.values()):8d}")
    if session_wall is not None:
        lines.append(f"session wall clock (collection and parallel workers included): {session_wall:.0f} s")
    return "\n".join(lines)


def slowest(rows: list[dict], n: int = 15) -> str:
    top = sorted(rows, key=lambda r: -r["wall"])[:n]
    return "\n".join(f"{r['wall']:8.1f} s  {kind_of(r['nodeid'], r['slow'], r.get('procs'))[:24]:<24}  {r['nodeid']}"
                     for r in top)


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path, help="a --kind-profile JSON-lines file or a JUnit XML")
    parser.add_argument("--slow-ids", type=Path, help="node ids of the slow tests, one a line (for a JUnit XML)")
    args = parser.parse_args(argv)
    ids = None
    if args.slow_ids:
        ids = {line.strip() for line in args.slow_ids.read_text().splitlines() if "::" in line}
    rows = load_rows(args.file, ids)
    print(table(rows))
    print("\nslowest tests:\n" + slowest(rows))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
