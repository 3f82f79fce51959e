"""`labkit preflight` on a GPU node hands its matmul measurement to the planner (issue 19's "measured on
the node ... and used from then on"). The probe itself needs CUDA; everything after it runs here."""
from __future__ import annotations

import json

from labkit.parallel import perf_model
from labkit.course import preflight
from labkit.profiles import get_profile


def test_a_gpu_nodes_matmul_probe_becomes_the_planners_efficiency(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    before = perf_model.matmul_efficiency("a100-80gb", "bf16")
    assert "published" in before.source or "default" in before.source
    (tmp_path / "probes.json").write_text(json.dumps({"allreduce": [], "matmul": {"tflops": 249.6}}))
    [line] = preflight.record_matmul(tmp_path, get_profile("a100x4"))
    assert line.status == "ok" and "80%" in line.detail and "labkit plan" in line.detail
    after = perf_model.matmul_efficiency("a100-80gb", "bf16")
    assert after.value == 0.8 and "labkit preflight" in after.source
    # A second node measurement replaces the first; other GPUs and precisions are kept.
    perf_model.record_measurement("v100-32gb", "fp16", 100.0, tool="labkit preflight")
    perf_model.record_measurement("a100-80gb", "bf16", 234.0, tool="labkit preflight")
    rows = json.loads((tmp_path / "cache" / perf_model.PERF_FILE_NAME).read_text())["measurements"]
    assert sorted((r["gpu"], r["efficiency"]) for r in rows) == [("a100-80gb", 0.75), ("v100-32gb", 0.8)]


def test_cpu_profiles_and_missing_probes_record_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "probes.json").write_text(json.dumps({"allreduce": [], "matmul": {"tflops": 0.04}}))
    assert preflight.record_matmul(tmp_path, get_profile("smoke")) == []
    assert preflight.record_matmul(tmp_path / "nowhere", get_profile("a100x4")) == []
    assert not (tmp_path / "cache").exists()
