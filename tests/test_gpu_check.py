"""`make gpu-check` (issue 38): under 8 minutes by construction -- every check has its own cap, the caps fit
the budget with a margin, each check runs in its own interpreter and is killed (with what it started) at its
cap, a fail naming the cap -- and it rehearses on CPU: every check reports pass / fail / skipped with why,
the GPU-only ones skipped naming the CPU test that covers them. The fast tests start only interpreters
that import no torch; the slow one runs the real script (~10 CPU s: a tiny training run for the memory check)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from labkit.course import gpu_check, gpu_checks
from labkit.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # starts an interpreter that trains a tiny model
def test_make_gpu_check_rehearses_on_cpu(tmp_path):
    out = tmp_path / "gpu-check"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    report = json.loads((out / "report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(checks) >= 8 and report["gpu"] is False
    assert all(c["status"] in ("pass", "fail", "skipped") for c in checks.values())
    assert checks["machine"]["status"] == checks["memory: estimator vs measured"]["status"] == "pass"
    skipped = [c for c in checks.values() if c["status"] == "skipped"]
    assert skipped and all("needs a CUDA GPU (on CPU: " in c["why"] and "tests/test_" in c["why"]
                           for c in skipped)
    assert "| notebook 02_single_gpu | skipped |" in (out / "report.md").read_text()


def test_every_check_has_a_cap_and_the_caps_fit_eight_minutes_with_a_margin():
    caps = [c.cap_s for c in gpu_check.CHECKS]
    assert gpu_check.BUDGET_S <= 480 and all(cap > 0 for cap in caps)
    assert sum(caps) <= gpu_check.BUDGET_S - gpu_check.MARGIN_S, f"caps sum to {sum(caps)} s"
    assert len({c.key for c in gpu_check.CHECKS}) == len({c.name for c in gpu_check.CHECKS}) == len(caps) >= 8


def test_a_spent_budget_still_reports_every_check(tmp_path):
    results = gpu_check.run_checks(tmp_path, budget_s=0, gpu=False)
    assert [r.name for r in results] == [c.name for c in gpu_check.CHECKS]
    assert {r.status for r in results} == {"skipped"} and "cap does not fit the 0 s left" in results[0].why
    assert json.loads((tmp_path / "report.json").read_text())["counts"]["skipped"] == len(results)


def test_a_smaller_budget_skips_what_no_longer_fits_and_the_checker_never_imports_torch(tmp_path):
    wheels = next(c for c in gpu_check.CHECKS if c.key == "wheels")
    machine_cap = next(c for c in gpu_check.CHECKS if c.key == "machine").cap_s
    budget = wheels.cap_s + 2  # room for the wheels check (after its start), none for the machine's
    assert budget < machine_cap
    script = textwrap.dedent(f"""
        import json, sys
        from labkit.course import gpu_check
        results = gpu_check.run_checks({str(tmp_path)!r}, budget_s={budget}, gpu=False)
        print(json.dumps({{"torch": "torch" in sys.modules, "checks": {{r.name: [r.status, r.why] for r in results}}}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["torch"] is False  # the parent of every check never imports torch, let alone CUDA (G1)
    machine, wheels_result = seen["checks"]["machine"], seen["checks"]["wheels"]
    assert machine[0] == "skipped" and f"its {machine_cap:.0f}-s cap does not fit the {budget:.0f} s left" in machine[1]
    assert wheels_result[0] == "pass"  # it fits, so it runs, in its own interpreter
    assert seen["checks"]["memory: estimator vs measured"][0] == "skipped"


def test_a_check_over_its_cap_is_a_fail_naming_the_cap_never_a_hang(tmp_path):
    result = gpu_check.run_capped([sys.executable, "-c", "import time; time.sleep(600)"], 1, tmp_path / "hang.log")
    assert result.status == "fail" and "over its 1-s cap" in result.why


def test_a_check_that_dies_is_a_fail_that_keeps_what_it_measured(tmp_path):
    child = ("import json, os; print(%r + json.dumps({'partial': {'rows': [1]}})); print('CUDA error: boom', "
             "flush=True); os._exit(9)" % gpu_checks.MARK)
    result = gpu_check.run_capped([sys.executable, "-c", child], 60, tmp_path / "dies.log")
    assert result.status == "fail" and "exited 9 without a result: CUDA error: boom" in result.why
    assert result.data == {"rows": [1]}


def test_what_a_check_leaves_running_in_its_own_session_is_killed_with_it(tmp_path):
    script = textwrap.dedent(f"""
        import json, os, sys
        from pathlib import Path
        from labkit.course import gpu_check
        assert gpu_check.become_subreaper()
        child = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
                 "time.sleep(600)'], start_new_session=True); print('grandchild', p.pid, flush=True)")
        log = Path({str(tmp_path)!r}) / "orphan.log"
        result = gpu_check.run_capped([sys.executable, "-c", child], 60, log, reap=True)
        pid = int(next(l for l in log.read_text().splitlines() if l.startswith("grandchild")).split()[1])
        try:
            os.kill(pid, 0); alive = True
        except ProcessLookupError:
            alive = False
        if alive:  # the test fails; the process must not outlive it
            os.kill(pid, 9)
        print(json.dumps({{"status": result.status, "left": result.data.get("left_behind"), "alive": alive}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["status"] == "fail" and seen["alive"] is False and "time.sleep(600)" in seen["left"][0]


def test_only_reruns_the_chosen_checks_and_keeps_the_rest_of_the_last_report(tmp_path):
    gpu_check.run_checks(tmp_path, budget_s=0, gpu=False)
    results = {r.name: r for r in gpu_check.run_checks(tmp_path, gpu=False, only="wheels")}
    assert results["wheels"].status == "pass" and "earlier" not in results["wheels"].data
    assert results["machine"].status == "skipped" and "earlier" in results["machine"].data
    assert "(from the run of " in (tmp_path / "report.md").read_text()
    with pytest.raises(ConfigError, match="'wheel'.*wheels"):
        gpu_check.chosen("wheel")
    assert gpu_check.main(["--only", "wheel", "--out", str(tmp_path)]) == 2


def test_the_wheels_fit_and_are_pinned():
    assert sum(gpu_check.WHEELS.values()) <= 60
    pins = gpu_check.pinned_wheels(ROOT / "requirements" / "lock.txt")
    assert len(pins) == len(gpu_check.WHEELS) and all("==" in p for p in pins)


def test_the_notebooks_it_runs_exist():
    assert set(gpu_check.NOTEBOOKS) == {"00_setup", "01_memory", "02_single_gpu", "06_peft"}
    assert all((ROOT / "notebooks" / f"{name}.ipynb").is_file() for name in gpu_check.NOTEBOOKS)


def test_the_docs_state_each_cap_as_the_table_has_it():
    text = (ROOT / "docs" / "gpu-node.md").read_text()
    for check in gpu_check.CHECKS:
        if not check.key.startswith("nb-"):
            assert f"(`{check.key}`) | {check.cap_s:g} s |" in text, check.key
    notebooks = [c for c in gpu_check.CHECKS if c.key.startswith("nb-")]
    assert f"| {', '.join(f'{c.cap_s:g}' for c in notebooks)} s |" in text


@pytest.mark.slow  # starts a notebook kernel
def test_the_notebook_check_runs_a_notebook_through_papermill_on_cpu(tmp_path):
    """The GPU-only notebook check's own code (kernel spec, papermill's integer cell timeout), on smoke."""
    import time

    ctx = gpu_checks.Context(out=tmp_path, gpu=False, deadline=time.monotonic() + 300, profile="smoke")
    result = gpu_checks.check_notebook(ctx, "00_setup")
    assert result.status == "pass", result.why
    assert (tmp_path / "executed" / "00_setup.ipynb").is_file()


def test_each_gpu_only_check_names_cpu_tests_that_exist():
    import re

    for check in gpu_check.CHECKS:
        named = re.findall(r"tests/test_\w+\.py", check.cpu)
        assert bool(named) == bool(check.cpu), check.key
        assert all((ROOT / path).is_file() for path in named), (check.key, named)
