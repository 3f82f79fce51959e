"""labkit.runtime.envinfo and `labkit env`: facts of this (GPU-less) machine and the profile verdicts."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from labkit.runtime import envinfo
from labkit.profiles import PROFILES


@pytest.fixture(scope="module")
def facts():
    return envinfo.collect()


def gpu_facts(*devices: tuple[str, float, bool]) -> dict:
    """`collect()`-shaped facts of a CUDA machine with `devices` = (name, GB, bf16) tuples."""
    return {"torch": {"installed": True, "gloo": True, "nccl_backend": True, "devices": [
        {"index": i, "name": n, "memory_gb": gb, "capability": [8, 0] if bf16 else [7, 0], "bf16": bf16}
        for i, (n, gb, bf16) in enumerate(devices)]}, "packages": {}}


def test_collect_reports_this_machine(facts):
    from importlib import metadata

    import torch

    assert facts["python"]["executable"] == sys.executable
    assert facts["packages"]["deepspeed"] == metadata.version("deepspeed")
    assert facts["packages"]["torch"] == metadata.version("torch")
    assert facts["torch"]["version"] == torch.__version__
    assert facts["torch"]["gloo"] is True
    assert facts["host"]["cpu_cores"] >= 1 and facts["host"]["ram_gb"] > 0
    json.dumps(facts)  # JSON-ready


def test_this_machine_runs_smoke_and_without_gpu_only_smoke(facts):
    assert "smoke" in envinfo.runnable(facts)
    if facts["torch"]["devices"]:  # a GPU node: the GPU verdicts are covered by the tests below
        return
    cpu = sorted(name for name, make in PROFILES.items() if make().device == "cpu")  # smoke, smoke-bf16
    assert sorted(envinfo.runnable(facts)) == cpu
    for name in set(PROFILES) - set(cpu):
        assert facts["profiles"][name]["missing"] == ["no CUDA device found -> use --profile smoke"]
    assert any("no GPU: only the smoke profile runs here" in line for line in facts["fixes"])


def test_four_a100s_run_every_profile():
    support = envinfo.profile_support(gpu_facts(*[("NVIDIA A100-SXM4-80GB", 85.1, True)] * 4))
    assert all(info["ok"] for info in support.values()), support


def test_v100s_cannot_run_bf16_profiles():
    support = envinfo.profile_support(gpu_facts(*[("Tesla V100-SXM2-32GB", 34.1, False)] * 4))
    assert support["v100x4"]["ok"] and support["smoke"]["ok"]
    assert not support["a100x4"]["ok"]
    assert any("bfloat16" in m and "v100x4" in m for m in support["a100x4"]["missing"])


def test_too_few_gpus_is_explained():
    support = envinfo.profile_support(gpu_facts(("NVIDIA A100 80GB", 85.1, True)))
    assert support["a100x1"]["ok"] and not support["a100x4"]["ok"]
    assert "needs 4 GPU(s) with >= 80 GB, found 1" in support["a100x4"]["missing"][0]


def test_missing_packages_name_the_install_command():
    facts = {"packages": {"deepspeed": None, "torch": "2.14.1"}, "torch": {"installed": True, "devices": []}}
    lines = envinfo.fixes(facts)
    assert "deepspeed is not installed -> pip install deepspeed" in lines
    assert not any(line.startswith("torch ") for line in lines)


def test_human_report_says_plainly_no_gpu(facts):
    text = envinfo.format_report(facts)
    assert "no GPU: only the smoke profile runs here" in text
    assert "smoke      yes" in text


def test_cli_json_is_valid_json_on_stdout_and_never_imports_deepspeed():
    # -X importtime lists every import on stderr: importing DeepSpeed could JIT-build its ops and
    # importing bitsandbytes prints warnings, so versions must come from package metadata only.
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "labkit", "env", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["profiles"]["smoke"]["ok"] is True
    assert set(data["profiles"]) == set(PROFILES)
    assert data["lock"]["matches"] is True and data["lock"]["differences"] == []  # tests/test_lock.py: when not
    assert set(data["driver"]) == {"version", "gpus"}
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time")}
    assert "torch" in imported  # the import log is really there ...
    assert {"deepspeed", "bitsandbytes"}.isdisjoint(imported)  # ... and names neither


def test_labkit_env_names_the_torch_build_cpu_or_cuda(facts):
    import torch

    text = envinfo.format_report(facts)
    want = f"CUDA build {torch.version.cuda}" if torch.version.cuda else "CPU build"  # this machine's, as installed
    assert f"torch build  {want}; NCCL " in text
    cpu = {**facts, "torch": {**facts["torch"], "cuda_build": None, "nccl": None, "devices": []}}
    assert "torch build  CPU build; NCCL -; gloo yes" in envinfo.format_report(cpu).splitlines()
    cuda = {**facts, "torch": {**facts["torch"], "cuda_build": "12.6"}}
    assert "torch build  CUDA build 12.6; NCCL " in envinfo.format_report(cuda)
    assert "cuda build" not in envinfo.format_report(cpu) + envinfo.format_report(cuda)


def test_a_cuda_build_without_a_driver_names_the_cpu_build_as_the_fix(facts):
    no_gpu = {"packages": {}, "host": {"system": "Linux"}, "driver": {"version": None, "gpus": []},
              "torch": {"installed": True, "cuda_build": "13.0", "devices": []}}
    assert envinfo.UNUSED_CUDA in envinfo.fixes(no_gpu)
    cpu_build = {**no_gpu, "torch": {**no_gpu["torch"], "cuda_build": None}}
    assert envinfo.UNUSED_CUDA not in envinfo.fixes(cpu_build)  # the CPU build: nothing to fix
    with_driver = {**no_gpu, "driver": {"version": "580.95.05", "gpus": []}}
    assert envinfo.UNUSED_CUDA not in envinfo.fixes(with_driver)  # a driver: the CUDA libraries may serve
