"""Hostile submissions for `labkit grade --execute`: the code cell each student inserts into the demo notebook.

Each cell tries one thing a student could do to other students or to the grader (issue 20), without
guarding it: inside the sandbox it must fail, and the failure is that student's reason.
"""
from __future__ import annotations

from pathlib import Path

#: Written into the instructor's private checks file; must never reach any file the batch writes.
PRIVATE_MARK = "PRIVATE-expected-value-7731"

PRIVATE_CHECKS = f'''
from labkit.course.grading.checks import answer_close
# {PRIVATE_MARK}
CHECKS = {{"90_grading_demo": [answer_close("private ratio", 1, "secret_ratio", 0.4242, rtol=0.01, visible=False)]}}
'''

FILL_SCRATCH = 'with open("fill.bin", "wb") as f:\n    while True:\n        f.write(b"x" * 2**20)'
KILL_PARENT = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"


def cells(*, neighbour: Path, other: Path, checks: Path, out: Path, outside: Path, grader_pid: int) -> dict[str, str]:
    """student -> the hostile cell; paths are the host's, as a student who knows the layout would write them."""
    return {
        "overwriter": f'open({str(neighbour)!r}, "w").write("{{}}")',
        "peeker": f"print(open({str(other)!r}).read()[:4000])",
        "checkreader": f"print(open({str(checks)!r}).read())",
        "outwriter": f'open({str(out / "grades.csv")!r}, "w").write("student,score\\nme,100\\n")',
        "outsider": f'open({str(outside)!r}, "w").write("was here")',
        "filler": FILL_SCRATCH,
        "parentkiller": KILL_PARENT,
        "graderkiller": f"import os, signal\nos.kill({grader_pid}, signal.SIGKILL)",
    }
