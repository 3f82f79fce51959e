"""`labkit preflight` keeps its matmul measurement beside its own output (issue 25, finding 7): one 8192^2 GEMM
must not replace the planner's fitted efficiency in a cache every student on the node shares -- 07/09 plans
would shift 15-25 % and graded answers miss the grader's recomputation. The planner uses a measurement only
when passed one (`--measured FILE`). The probe needs CUDA; everything after it runs here on injected numbers."""
from __future__ import annotations

import json

import pytest

from labkit.course import preflight
from labkit.errors import ConfigError
from labkit.parallel import perf_model, planner
from labkit.profiles import get_profile


def _probes(*tflops: float, device: str = "NVIDIA A100 80GB PCIe") -> dict:
    return {"run_id": "x", "allreduce": [], "comm": [],
            "matmul": [{"rank": r, "tflops": t, "device": device} for r, t in enumerate(tflops)]}


def test_the_matmul_probe_stays_in_the_preflight_folder_and_the_planner_is_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(perf_model.PERF_FILE_ENV, raising=False)
    out = tmp_path / "preflight"
    out.mkdir()
    before = perf_model.matmul_efficiency("a100-80gb", "bf16")
    [line] = preflight.record_matmul(out, get_profile("a100x4"), _probes(249.6, 240.0, 252.0, 230.0))
    assert line.status == "ok" and "244.8 TFLOPS = 78%" in line.detail  # the median of the four GPUs
    assert f"keeps its fitted {before.value:.0%}" in line.detail and "--matmul-efficiency 0.78" in line.detail
    saved = out / perf_model.PERF_FILE_NAME
    assert f"--measured {saved}" in line.detail
    assert perf_model.matmul_efficiency("a100-80gb", "bf16") == before  # `labkit plan` did not move
    assert planner.PlanRequest(model="llama2-7b", gpus=8, gpus_per_node=8).efficiency == before
    assert not (tmp_path / "cache").exists()  # nothing in the shared cache
    [row] = json.loads(saved.read_text())["measurements"]
    assert (row["gpu"], row["precision"], row["efficiency"], row["tool"]) == ("a100-80gb", "bf16", 0.7846, "labkit preflight")
    # Planning with it is an explicit choice: the file passed as --measured.
    measured = planner.PlanRequest(model="llama2-7b", gpus=8, gpus_per_node=8, measured=str(saved)).efficiency
    assert measured.value == 0.7846 and "labkit preflight" in measured.source


def test_an_h100_probe_is_recorded_under_the_planner_s_name(tmp_path):
    [line] = preflight.record_matmul(tmp_path, get_profile("h100x1"), _probes(692.3, device="NVIDIA H100 80GB HBM3"))
    assert "70%" in line.detail
    req = planner.PlanRequest(model="llama3-8b", gpus=8, gpus_per_node=8, gpu="h100-sxm",
                              measured=str(tmp_path / perf_model.PERF_FILE_NAME))
    assert req.efficiency.value == 0.7


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
