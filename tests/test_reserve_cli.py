"""`labkit reserve check|plan|create`: output format, exit codes, plan -> check round trip."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from labkit.cli.reserve import command
from labkit.course.reserve import CODES

ROOT = Path(__file__).resolve().parent.parent
POLICY = str(ROOT / "reservations" / "policy.yaml")
DATA = Path(__file__).resolve().parent / "data" / "reserve"
CORPUS = str(DATA / "leases_every_code.csv")


def run(*args: str):
    return CliRunner().invoke(command, list(args), catch_exceptions=False)


def test_check_prints_one_violation_per_line_and_exits_0():
    result = run("check", CORPUS, "--policy", POLICY)
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert len(lines) == 17 and {line.split(":")[0] for line in lines} == set(CODES)
    assert "17 violation(s)" in result.stderr


def test_check_json_is_a_list_of_the_six_fields():
    result = run("check", CORPUS, "--policy", POLICY, "--json")
    assert result.exit_code == 0
    found = json.loads(result.stdout)
    assert {tuple(sorted(v)) for v in found} == {("code", "end", "message", "node", "start", "user")}
    assert {v["code"] for v in found} == set(CODES)


@pytest.mark.parametrize("content", [None, "", "name,when\nann,today\n"])
def test_check_exits_2_when_the_file_cannot_be_read(tmp_path, content):
    path = tmp_path / "leases.csv"
    if content is not None:
        path.write_text(content)
    result = run("check", str(path), "--policy", POLICY)
    assert result.exit_code == 2 and "error:" in result.stderr


def test_plan_writes_ics_and_csv_that_pass_check(tmp_path):
    ics, csv_path = tmp_path / "schedule.ics", tmp_path / "schedule.csv"
    result = run("plan", "--roster", str(DATA / "roster60.csv"), "--policy", POLICY, "--from", "2025-02-13",
                 "--to", "2025-02-27", "--out", str(ics), "--csv", str(csv_path))
    assert result.exit_code == 0, result.output
    assert "59 served, 1 not served" in result.stdout and "s51:" in result.stdout
    assert ics.read_bytes().startswith(b"BEGIN:VCALENDAR\r\n")
    checked = run("check", str(csv_path), "--policy", POLICY, "--json")
    assert checked.exit_code == 0 and json.loads(checked.stdout) == []
    assert "0 violation(s)" in checked.stderr


def test_create_dry_run_prints_the_request_after_checking_it():
    result = run("create", "--node-type", "gpu_a100_pcie", "--start", "2025-02-21T14:00:00-05:00",
                 "--hours", "3", "--dry-run", "--policy", POLICY, "--name", "labkit_ann")
    assert result.exit_code == 0, result.output
    request = json.loads(result.stdout)
    assert request["node"] == "307G3Q3" and request["name"] == "labkit_ann"
    assert (request["start_date"], request["end_date"]) == ("2025-02-21 19:00", "2025-02-21 21:55")
    assert json.loads(request["reservations"][0]["resource_properties"]) == ["==", "$node_name", "307G3Q3"]
    assert "policy check: OK" in result.stderr


def test_create_picks_the_2h_node_for_a_2h_block():
    result = run("create", "--node-type", "gpu_a100_pcie", "--start", "2025-02-21T10:00:00-05:00",
                 "--hours", "2", "--dry-run", "--policy", POLICY)
    assert json.loads(result.stdout)["node"] == "JOBG3Q3"


def test_create_refuses_a_request_that_breaks_the_policy(monkeypatch):
    monkeypatch.setitem(sys.modules, "chi", None)  # nothing may be submitted, even if python-chi existed
    result = run("create", "--node-type", "compute_gigaio", "--start", "2025-02-18T14:30:00-05:00",
                 "--hours", "3", "--policy", POLICY)
    assert result.exit_code == 1
    codes = {line.split(":")[0] for line in result.stdout.splitlines() if ": you " in line}
    assert codes == {"too_long", "not_on_hour", "bad_end", "outside_window"}
    assert "nothing was submitted" in result.stderr


def test_create_without_python_chi_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "chi", None)  # python-chi is not in the course venv
    result = run("create", "--node-type", "gpu_a100_pcie", "--start", "2025-02-21T14:00:00-05:00",
                 "--hours", "3", "--policy", POLICY)
    assert result.exit_code == 2 and "pip install python-chi" in result.stderr


def test_naive_start_is_refused_with_the_offset_to_add():
    result = run("create", "--node-type", "gpu_a100_pcie", "--start", "2025-02-21T14:00", "--hours", "3",
                 "--dry-run", "--policy", POLICY)
    assert result.exit_code == 2 and "2025-02-21T14:00:00-05:00" in result.stderr


def test_the_labkit_entry_point_runs_reserve_check():
    proc = subprocess.run([sys.executable, "-m", "labkit", "reserve", "check", CORPUS, "--policy", POLICY, "--json"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)) == 17
