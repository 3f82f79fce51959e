"""`labkit preflight` records a GPU node's matmul measurement; the planner uses it only when asked (issue 25,
finding 7: a probe written to a cache shared by every student on the node must not shift their plans and the
answers graded against the planner). The probe itself needs CUDA; everything after it runs here."""
from __future__ import annotations

import json

import pytest

from labkit.course import preflight
from labkit.errors import ConfigError
from labkit.parallel import hardware, planner
from labkit.profiles import get_profile


def test_a_recorded_probe_is_used_only_when_passed(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(hardware.PERF_FILE_ENV, raising=False)
    before = hardware.matmul_efficiency("a100-80gb", "bf16")
    (tmp_path / "probes.json").write_text(json.dumps({"allreduce": [], "matmul": {"tflops": 249.6}}))
    [line] = preflight.record_matmul(tmp_path, get_profile("a100x4"))
    assert line.status == "ok" and "80%" in line.detail
    saved = tmp_path / "cache" / hardware.PERF_FILE_NAME
    assert saved.is_file()
    assert hardware.matmul_efficiency("a100-80gb", "bf16") == before  # nothing read behind the caller's back
    assert planner.PlanRequest(model="llama2-7b", gpus=8, gpus_per_node=8).efficiency == before
    measured = planner.PlanRequest(model="llama2-7b", gpus=8, gpus_per_node=8, measured=str(saved)).efficiency
    assert measured.value == 0.8 and "labkit preflight" in measured.source
    # A second node measurement replaces the first; other GPUs and precisions are kept.
    hardware.record_measurement("v100-32gb", "fp16", 100.0, tool="labkit preflight")
    hardware.record_measurement("a100-80gb", "bf16", 234.0, tool="labkit preflight")
    rows = json.loads(saved.read_text())["measurements"]
    assert sorted((r["gpu"], r["efficiency"]) for r in rows) == [("a100-80gb", 0.75), ("v100-32gb", 0.8)]


def test_an_h100_probe_is_recorded_under_the_planner_s_name(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(hardware.PERF_FILE_ENV, raising=False)
    (tmp_path / "probes.json").write_text(json.dumps({"allreduce": [], "matmul": {"tflops": 692.3}}))
    [line] = preflight.record_matmul(tmp_path, get_profile("h100x1"))
    assert "70%" in line.detail
    saved = tmp_path / "cache" / hardware.PERF_FILE_NAME
    req = planner.PlanRequest(model="llama3-8b", gpus=8, gpus_per_node=8, gpu="h100-sxm", measured=str(saved))
    assert req.efficiency.value == 0.7


def test_cpu_profiles_and_missing_probes_record_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(hardware.PERF_FILE_ENV, raising=False)
    (tmp_path / "probes.json").write_text(json.dumps({"allreduce": [], "matmul": {"tflops": 0.04}}))
    assert preflight.record_matmul(tmp_path, get_profile("smoke")) == []
    assert preflight.record_matmul(tmp_path / "nowhere", get_profile("a100x4")) == []
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("content,match", [("{not json", "cannot read matmul measurements"),
                                           ('{"measurements": [{"gpu": "a100-80gb", "efficiency": 1.5}]}',
                                            r"efficiency=1\.5"),
                                           ('{"measurements": [{"gpu": "h100-sxm", "efficiency": 0.7}]}',
                                            "no measurement for a100-80gb")])
def test_a_broken_or_foreign_measurement_says_what_to_do(tmp_path, content, match):
    perf = tmp_path / "perf.json"
    perf.write_text(content)
    with pytest.raises(ConfigError, match=match):
        planner.PlanRequest(model="llama2-7b", gpus=8, gpus_per_node=8, measured=str(perf))
