"""Run one exercise's tests on a student's cell in a separate, limited process (`labkit check` / `labkit grade`).

The parent (`run_exercise`) starts `python -m labkit.course.exercises.runner`, optionally inside the grading
sandbox (labkit.course.grading.isolation: read-only file system, private scratch, no network, own PID namespace), and
sends the job on stdin: the cell's source (one or more variants: the CI's mutants) and the test files' text,
so the sandbox never sees the hidden tests' folder. The runner sets the memory cap (RLIMIT_AS, inherited by
spawned ranks), executes the cell in a fresh namespace and runs every case of the exercise; it writes one JSON
report to an inherited file descriptor. Whatever the student's code prints goes to a pipe the parent counts:
past the output cap, or past the timeout, the whole process tree is killed and the exercise gets a reason.
Limit: the student's function runs in the same process as the tests, so a hostile submission can inspect
the tests or forge the report; this catches mistakes and runaway code, it is not proof against cheating.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

OK, TIMEOUT, OUTPUT_CAP, CRASHED = "ok", "timeout", "output_cap", "crashed"
_POLL_S = 0.1


@dataclass(frozen=True)
class Outcome:
    """What running one exercise's tests gave: per variant, an error or per-case results."""

    status: str
    """ok, timeout, output_cap or crashed (then `reason` says why and there are no results)."""
    reason: str = ""
    variants: tuple = ()
    """Per source variant: {"error": str} or {"results": [{"name", "hidden", "points", "status", "message"}]}."""


def payload_of(paths, hidden: bool) -> list[dict]:
    return [{"file": Path(p).name, "text": Path(p).read_text(), "hidden": hidden} for p in paths]


def _reader(pipe, cap: int, state: dict) -> None:
    tail = b""
    while True:
        chunk = pipe.read(65536)
        if not chunk:
            break
        state["bytes"] += len(chunk)
        tail = (tail + chunk)[-4000:]
        state["tail"] = tail
        if state["bytes"] > cap:
            state["over"] = True
    pipe.close()


def run_exercise(exercise: str, sources: list[str], tests: list[dict], *, timeout_s: float,
                 memory_bytes: int, output_bytes: int, isolation=None, private: tuple = (),
                 scratch_bytes: int = 512 * 2**20, kernel: str = "labkit", reveal_hidden: bool = False) -> Outcome:
    """Run the cases of `exercise` from `tests` on each source variant; never raises for what the code does.
    A hidden test's message comes back only with `reveal_hidden` (CI and authors, never students)."""
    from labkit.course.grading import isolation as iso_mod
    from labkit.course.grading.sandbox import kill_process_tree, scratch_env

    job = json.dumps({"exercise": exercise, "sources": sources, "tests": tests, "reveal": reveal_hidden}).encode()
    with tempfile.TemporaryDirectory(prefix="labkit-exercise-") as tmp:
        work = Path(tmp).resolve()
        scratch = work if isolation is not None and isolation.level == iso_mod.BUBBLEWRAP else work / "scratch"
        scratch.mkdir(exist_ok=True)
        argv = [sys.executable, "-m", "labkit.course.exercises.runner", str(scratch), str(memory_bytes)]
        if isolation is None:
            cmd, env = argv, {**os.environ, "PYTHONPATH": iso_mod.labkit_path()}
        else:
            view = iso_mod.View(scratch, scratch_bytes, private=tuple(private), masked=iso_mod.default_masked(),
                                needed=iso_mod.runtime_paths(kernel))
            cmd, env = None, scratch_env(scratch, kernel)
            env["MPLBACKEND"] = "Agg"
        report_path = work / "report.json"
        with report_path.open("wb") as report:
            full = argv + ["--report-fd", str(report.fileno())]
            cmd = full if isolation is None else iso_mod.command(isolation, view, full)
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    pass_fds=(report.fileno(),), start_new_session=True, env=env, cwd=work)
            state = {"bytes": 0, "tail": b"", "over": False}
            reader = threading.Thread(target=_reader, args=(proc.stdout, output_bytes, state), daemon=True)
            reader.start()
            try:
                proc.stdin.write(job)
                proc.stdin.close()
            except BrokenPipeError:
                pass
            deadline, killed = time.monotonic() + timeout_s, None
            while proc.poll() is None:
                if state["over"] or time.monotonic() > deadline:
                    killed = OUTPUT_CAP if state["over"] else TIMEOUT
                    kill_process_tree(proc.pid)
                    break
                time.sleep(_POLL_S)
            proc.wait()
            reader.join(timeout=5)
        if state["over"] or killed == OUTPUT_CAP:
            return Outcome(OUTPUT_CAP, f"printed more than {output_bytes / 2**20:g} MiB; killed (print less)")
        if killed == TIMEOUT:
            return Outcome(TIMEOUT, f"still running after {timeout_s:g} s; killed (an endless loop, or a rank "
                           "waiting for a collective that never comes?)")
        try:
            data = json.loads(report_path.read_text())
            return Outcome(OK, "", tuple(data["variants"]))
        except (OSError, ValueError, KeyError, TypeError):
            tail = state["tail"].decode(errors="replace").strip().splitlines()[-3:]
            how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
            return Outcome(CRASHED, f"the test process died ({how}) before reporting" +
                           (f": {' | '.join(tail)[-300:]}" if tail else ""))


# ---------------------------------------------------------------- the runner (child process)
def _run_variant(exercise: str, source: str, cases, reveal: bool = False) -> dict:
    from labkit.course.exercises.cases import run_cases
    from labkit.course.exercises.source import to_python

    namespace = {"__name__": "labkit_submission"}
    try:
        code = to_python(source)
        if "get_ipython()" in code:  # a magic (%time, %%writefile): run it as IPython would
            from IPython.core.interactiveshell import InteractiveShell

            namespace["get_ipython"] = InteractiveShell.instance
        exec(compile(code, f"<exercise {exercise}>", "exec"), namespace)  # noqa: S102
    except BaseException as exc:  # noqa: BLE001 - the cell itself fails: every test fails with this reason
        return {"error": f"the exercise cell raised {type(exc).__name__}: {str(exc)[:200]}"}
    fn = namespace.get(exercise)
    if not callable(fn):
        return {"error": f"the exercise cell defines no function {exercise}(); restore its `def {exercise}(...)`"}
    results = run_cases(fn, cases)
    return {"results": [{"name": r.case.name, "hidden": r.case.hidden, "points": r.case.points,
                         "status": r.status, "message": "" if r.case.hidden and not reveal else r.message[:500]}
                        for r in results]}


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m labkit.course.exercises.runner")
    parser.add_argument("scratch", type=Path)
    parser.add_argument("memory", type=int)
    parser.add_argument("--report-fd", type=int, required=True)
    args = parser.parse_args(argv)
    os.set_inheritable(args.report_fd, False)
    for name in ("home", "tmp", "cache", "config", "mpl", "ipython", "runtime"):
        (args.scratch / name).mkdir(parents=True, exist_ok=True)
    os.chdir(args.scratch)
    from labkit.course.grading.sandbox import _apply_limits

    _apply_limits(args.memory, 2**30)
    job = json.loads(sys.stdin.read())
    from labkit.course.exercises.cases import load_cases_from_text

    cases = [c for t in job["tests"] for c in load_cases_from_text(t["text"], t["file"], hidden=t["hidden"])
             if c.exercise == job["exercise"]]
    variants = [_run_variant(job["exercise"], src, cases, bool(job.get("reveal"))) for src in job["sources"]]
    sys.stdout.flush()
    with os.fdopen(args.report_fd, "w", closefd=False) as out:
        out.write(json.dumps({"variants": variants}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
