"""LEGACY (remove when the last lab is ported to the judge): tests run IN the student's process.

For the exercises a test file still lists in `LEGACY` (labs not yet ported to `student.call / run / spawn`),
`run_exercise` starts `python -m labkit.course.exercises.runner` (sandboxed like the judge's process,
labkit.course.exercises.process), sends the cell's source (one or more variants) and the test files' text on
stdin, and the child executes the cell and runs the cases beside it, writing one JSON report to an inherited
file descriptor. Student code there can read the tests and forge that report: the grader therefore takes
only pass / fail / not attempted per case NAME from it, with names, points and visibility from its own plan
(labkit.course.exercises.grading.legacy_results), the report's size checked before reading and messages
truncated. Porting an exercise to the judge (docs/grading.md, "Porting a legacy exercise") removes this path.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from labkit.course.exercises.process import exit_reason, launch

OK, TIMEOUT, OUTPUT_CAP, CRASHED = "ok", "timeout", "output_cap", "crashed"
_POLL_S = 0.1
#: Largest report read back from the student's process.
MAX_REPORT = 4 * 2**20


@dataclass(frozen=True)
class Outcome:
    """What running one exercise's tests gave: per variant, an error or per-case results."""

    status: str
    """ok, timeout, output_cap or crashed (then `reason` says why and there are no results)."""
    reason: str = ""
    variants: tuple = ()
    """Per source variant, as the student's process reported it (untrusted): {"error": str} or
    {"results": [{"name", "status", "message"}]}."""


def payload_of(paths, hidden: bool) -> list[dict]:
    return [{"file": Path(p).name, "text": Path(p).read_text(), "hidden": hidden} for p in paths]


def run_exercise(exercise: str, sources: list[str], tests: list[dict], *, timeout_s: float,
                 memory_bytes: int, output_bytes: int, isolation=None, private: tuple = (),
                 scratch_bytes: int = 512 * 2**20, kernel: str = "labkit", reveal_hidden: bool = False) -> Outcome:
    """Run the cases of `exercise` from `tests` on each source variant; never raises for what the code does.
    A hidden test's message comes back only with `reveal_hidden` (CI and authors, never students)."""
    import subprocess

    from labkit.course.grading.confine import kill_process_tree

    job = json.dumps({"exercise": exercise, "sources": sources, "tests": tests, "reveal": reveal_hidden}).encode()
    with tempfile.TemporaryDirectory(prefix="labkit-exercise-") as tmp:
        work = Path(tmp).resolve()
        report_path = work / "report.json"
        with report_path.open("wb") as report:
            run = launch("labkit.course.exercises.runner", work, extra=["--report-fd", str(report.fileno())],
                         pass_fds=(report.fileno(),), memory_bytes=memory_bytes, output_bytes=output_bytes,
                         isolation=isolation, private=private, kernel=kernel, scratch_bytes=scratch_bytes,
                         stdin=subprocess.PIPE)
            proc = run.proc
            try:
                proc.stdin.write(job)
                proc.stdin.close()
            except BrokenPipeError:
                pass
            deadline, killed = time.monotonic() + timeout_s, None
            while proc.poll() is None:
                if run.output.over or time.monotonic() > deadline:
                    killed = OUTPUT_CAP if run.output.over else TIMEOUT
                    kill_process_tree(proc.pid)
                    break
                time.sleep(_POLL_S)
            proc.wait()
            capped = run.box.exceeded()
            run.box.close()
            run.output.join()
        if run.output.over or killed == OUTPUT_CAP:
            return Outcome(OUTPUT_CAP, f"printed more than {output_bytes / 2**20:g} MiB; killed (print less)")
        if killed == TIMEOUT:
            return Outcome(TIMEOUT, f"still running after {timeout_s:g} s; killed (an endless loop, or a rank "
                           "waiting for a collective that never comes?)")
        try:
            if report_path.stat().st_size > MAX_REPORT:
                return Outcome(CRASHED, f"its report is above the {MAX_REPORT // 2**20} MiB cap; refused unread")
            data = json.loads(report_path.read_text())
            return Outcome(OK, "", tuple(data["variants"]))
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            tail = run.output.last_lines() if not any(t["hidden"] for t in tests) and not capped else ""
            return Outcome(CRASHED, f"the exercise's process died ({capped or exit_reason(proc)}) before reporting" +
                           (f": {tail}" if tail else ""))


# ---------------------------------------------------------------- the runner (child process)
def _run_variant(exercise: str, source: str, cases, reveal: bool = False) -> dict:
    from labkit.course.exercises.server import CellError, load_cell
    from labkit.course.exercises.verdicts import run_cases

    try:
        fn = load_cell(exercise, source)
    except CellError as exc:
        return {"error": str(exc)}
    results = run_cases(fn, cases)
    return {"results": [{"name": r.case.name, "hidden": r.case.hidden, "points": r.case.points,
                         "status": r.status, "message": "" if r.case.hidden and not reveal else r.message[:500]}
                        for r in results]}


def main(argv: list[str]) -> int:
    from labkit.course.exercises.cases import load_cases_from_text
    from labkit.course.exercises.process import child_args
    from labkit.course.exercises.spawn import warm_ranks

    args = child_args(argv, "labkit.course.exercises.runner", "--report-fd")
    job = json.loads(sys.stdin.read())
    cases = [c for t in job["tests"] for c in load_cases_from_text(t["text"], t["file"], hidden=t["hidden"])
             if c.exercise == job["exercise"]]
    with warm_ranks():  # every variant's tests spawn ranks: fork them from one process that imported torch once
        variants = [_run_variant(job["exercise"], src, cases, bool(job.get("reveal"))) for src in job["sources"]]
    sys.stdout.flush()
    with os.fdopen(args.fd, "w", closefd=False) as out:
        out.write(json.dumps({"variants": variants}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
