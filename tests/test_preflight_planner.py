"""`labkit preflight` keeps its matmul measurement beside its own output (issue 25, finding 7): one 8192^2 GEMM
must not replace the planner's fitted efficiency in a cache every student on the node shares -- 07/09 plans
would shift 15-25 % and graded answers miss the grader's recomputation. The probe needs CUDA; everything
after it runs here on an injected measurement."""
from __future__ import annotations

import json

from labkit.course import preflight
from labkit.parallel import perf_model
from labkit.profiles import get_profile


def _probes(*tflops: float) -> dict:
    return {"run_id": "x", "allreduce": [], "comm": [],
            "matmul": [{"rank": r, "tflops": t, "device": "NVIDIA A100 80GB PCIe"} for r, t in enumerate(tflops)]}


def test_the_matmul_probe_stays_in_the_preflight_folder_and_the_planner_is_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(perf_model.PERF_FILE_ENV, raising=False)
    out = tmp_path / "preflight"
    out.mkdir()
    before = perf_model.matmul_efficiency("a100-80gb", "bf16")
    [line] = preflight.record_matmul(out, get_profile("a100x4"), _probes(249.6, 240.0, 252.0, 230.0))
    assert line.status == "ok" and "244.8 TFLOPS = 78%" in line.detail  # the median of the four GPUs
    assert f"keeps its fitted {before.value:.0%}" in line.detail and "--matmul-efficiency 0.78" in line.detail
    assert perf_model.matmul_efficiency("a100-80gb", "bf16") == before  # `labkit plan` did not move
    assert not (tmp_path / "cache").exists()  # nothing in the shared cache
    [row] = json.loads((out / perf_model.PERF_FILE_NAME).read_text())["measurements"]
    assert (row["gpu"], row["precision"], row["efficiency"], row["tool"]) == ("a100-80gb", "bf16", 0.7846, "labkit preflight")
    # In the planner's file format: planning with it is an explicit choice (--matmul-efficiency, the file).
    assert perf_model.read_perf_file(out / perf_model.PERF_FILE_NAME, "a100-80gb", "bf16").value == 0.7846


def test_a_second_measurement_replaces_the_first_and_keeps_other_gpus(tmp_path):
    path = tmp_path / perf_model.PERF_FILE_NAME
    perf_model.record_measurement("v100-32gb", "fp16", 100.0, tool="labkit preflight", path=path)
    perf_model.record_measurement("a100-80gb", "bf16", 249.6, tool="labkit preflight", path=path)
    perf_model.record_measurement("a100-80gb", "bf16", 234.0, tool="labkit preflight", path=path)
    rows = json.loads(path.read_text())["measurements"]
    assert sorted((r["gpu"], r["efficiency"]) for r in rows) == [("a100-80gb", 0.75), ("v100-32gb", 0.8)]


def test_cpu_profiles_and_missing_probes_record_nothing(tmp_path):
    assert preflight.record_matmul(tmp_path, get_profile("smoke"), _probes(0.04)) == []
    assert preflight.record_matmul(tmp_path, get_profile("a100x4"), None) == []
    assert list(tmp_path.iterdir()) == []
