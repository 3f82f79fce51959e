"""`make gpu-check` rehearses on CPU (issue 38): every check reports pass / fail / skipped with why, the
GPU-only ones are skipped naming the CPU test that covers them, and the report is written even when the
budget runs out. One run of the real script (~5 CPU s: a tiny training run for the memory check)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.course import gpu_check

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


def test_a_spent_budget_still_reports_every_check(tmp_path):
    results = gpu_check.run_checks(tmp_path, budget_s=0, gpu=False)
    assert [r.name for r in results] == [name for name, _ in gpu_check.CHECKS]
    assert {r.status for r in results} == {"skipped"} and "budget was spent" in results[0].why
    assert json.loads((tmp_path / "report.json").read_text())["counts"]["skipped"] == len(results)


def test_the_wheels_fit_and_are_pinned():
    assert sum(gpu_check.WHEELS.values()) <= 60
    pins = gpu_check.pinned_wheels(ROOT / "requirements" / "lock.txt")
    assert len(pins) == len(gpu_check.WHEELS) and all("==" in p for p in pins)


def test_the_notebooks_it_runs_exist():
    assert all((ROOT / "notebooks" / f"{name}.ipynb").is_file() for name in gpu_check.NOTEBOOK_BUDGET_S)
