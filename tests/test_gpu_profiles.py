"""GPU profiles checked on CPU: every lab run resolves and fits (labkit.course.profile_check), the precision
suits each GPU, a GPU profile without its GPUs stops in one line, and `labkit preflight` passes."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit import parallel
from labkit.runtime import envinfo
from labkit.course import notebooks as nbk
from labkit.course import profile_check as pc
from labkit.cli import main
from labkit.errors import HardwareError
from labkit.profiles import PROFILES, get_profile

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- every profile, every lab run
#: The profiles whose lab runs a rehearsal observed (labkit/data/lab_runs.json): the GPU profiles.
GPU_PROFILES = sorted(name for name in PROFILES if get_profile(name).device == "cuda")


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_every_lab_run_of_every_profile_resolves_and_fits(name):
    items = pc.check_profile(name)
    bad = [f"{i.lab} {i.label}: {i.reason}" for i in items if not i.ok]
    assert not bad, "\n".join(bad)
    profile = get_profile(name)
    sized = [i for i in items if i.bytes_per_gpu is not None]  # against HEADROOM of the GPU's memory
    assert sized and all(i.bytes_per_gpu <= pc.HEADROOM * profile.gpu_memory_gb * 1e9 for i in sized)
    if profile.nproc > 1:  # the multi-GPU labs are in the table, with their precision stated
        labs = {i.lab for i in items}
        assert {"03_ddp", "04_fsdp", "05_zero", "07_model_parallel", "08_profiling_and_stacking", "09_beyond_3d"} <= labs


def test_a_profile_that_would_oom_fails_with_the_bytes():
    big = get_profile("v100x4", llm_batch=64, seq_len=2048)
    bad = [i for i in pc.check_profile(big) if not i.ok]
    # each names its bytes and the memory it had: the GPU's 32 GB, or the cap a lesson sets (06's LoRA runs)
    assert bad and all("GB per GPU" in i.reason and f"{i.options.get('memory_cap_gb', 32):g} GB" in i.reason
                       for i in bad)
    assert all(i.bytes_per_gpu > i.capacity for i in bad)


@pytest.mark.parametrize("name, dtype", [("v100x4", "float16"), ("a100x4", "bfloat16"), ("a100x1", "bfloat16"),
                                         ("h100x1", "bfloat16"), ("t4x1", "float16"), ("t4x2", "float16")])
def test_each_gpu_gets_its_tensor_core_precision(name, dtype):
    profile = get_profile(name)
    assert profile.dtype == dtype and pc.precision_problem(profile) is None
    other = "bfloat16" if dtype == "float16" else "float16"
    problem = pc.precision_problem(dataclasses.replace(profile, dtype=other))
    assert problem and f"use {dtype}" in problem


def test_smoke_bf16_is_smoke_in_bf16():
    smoke, bf16 = get_profile("smoke"), get_profile("smoke-bf16")
    assert (bf16.device, bf16.backend, bf16.nproc, bf16.dtype) == ("cpu", "gloo", 2, "bfloat16")
    assert (bf16.llm_model, bf16.vision_model) == (smoke.llm_model, smoke.vision_model)
    assert pc.amp_of(bf16) == "bf16" and pc.amp_of(get_profile("v100x4")) == "fp16"


@pytest.mark.parametrize("strategy, fragment", [("fsdp", "shards transformer blocks"), ("lora", "image model"),
                                                ("pipeline-1f1b", "not an LLM"), ("tensor-fsdp", "not an LLM")])
def test_strategy_model_pairs_are_refused_with_a_reason(strategy, fragment):
    item = pc.check_run(get_profile("a100x4"), "x", "x", strategy, "resnet50", {"nproc": 4})
    assert not item.ok and fragment in item.reason


def test_pipelines_refuse_fp16_so_v100_runs_lab07_in_fp32():
    v100 = get_profile("v100x4")
    refused = pc.check_run(v100, "07", "x", "pipeline-1f1b", v100.llm_model, {"nproc": 4, "amp": "fp16"})
    assert not refused.ok and refused.reason
    runs = [r for r in pc.lab_runs(v100) if r[0] == "07_model_parallel"]
    assert runs and all(r[4]["amp"] == "none" for r in runs)


def test_single_gpu_llm_baselines_are_sized_from_the_estimator():
    # finding 10: fp32 TinyLlama 8 x 512 on a 32 GB V100 would OOM; checkpointing makes it fit.
    v100 = get_profile("v100x4")
    cfg = dict(strategy="single", model=v100.llm_model, profile="v100x4", amp="none")
    from labkit.memory.estimate import estimate
    from labkit.train.config import from_dict
    plain = estimate(pc.memory_config(from_dict(cfg).resolve())).total
    assert plain > pc.capacity(v100)
    levers = pc.single_levers(v100, v100.llm_model, amp="none")
    assert levers.get("checkpointing") is True
    assert estimate(pc.memory_config(from_dict({**cfg, **levers}).resolve())).total <= pc.capacity(v100)
    assert pc.single_levers(get_profile("a100x4"), "tinyllama-1.1b") == {}
    assert pc.single_levers(get_profile("smoke"), "tiny-llama") == {}


def test_explicit_precision_per_run_in_02_and_04():
    for name in ("a100x4", "v100x4", "h100x1"):
        runs = {(lab, label): opts for lab, label, _s, _m, opts in pc.lab_runs(get_profile(name))}
        assert runs[("02_single_gpu", "baseline")]["amp"] == "none"
        assert runs[("02_single_gpu", "amp")]["amp"] == pc.amp_of(get_profile(name))
        if ("04_fsdp", "fsdp-grad-op") in runs:
            assert runs[("04_fsdp", "fsdp-grad-op")]["amp"] == "none"


# ---------------------------------------------------------------- a GPU profile on this CPU machine
V100_NODE = {"torch": {"installed": True, "nccl_backend": True, "devices": [
    {"index": i, "name": "Tesla V100-SXM2-32GB", "memory_gb": 34.1, "capability": [7, 0], "bf16": False}
    for i in range(4)]}}


def test_require_names_what_is_missing_and_the_smoke_fix():
    with pytest.raises(HardwareError) as info:
        envinfo.require("a100x4", {"torch": {"installed": True, "devices": []}})
    text = str(info.value)
    assert "\n" not in text and "a100x4" in text and "no CUDA device" in text and "--profile smoke" in text
    with pytest.raises(HardwareError, match="bfloat16.*--profile v100x4"):
        envinfo.require("a100x4", V100_NODE)
    assert envinfo.require("v100x4", V100_NODE).name == "v100x4"
    assert envinfo.require("smoke-bf16").device == "cpu"
    assert HardwareError("x")._render_traceback_() == ["HardwareError: x"]


def test_a_cuda13_build_on_volta_names_the_cu126_wheel():
    cu13 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
    assert not envinfo.has_kernels(cu13, [7, 0]) and envinfo.has_kernels(cu13, [8, 0])
    assert envinfo.has_kernels(["sm_70", "sm_80"], [8, 6]) and envinfo.has_kernels(None, [7, 0])
    node = {"torch": {**V100_NODE["torch"], "version": "2.14.1+cu130", "arch_list": cu13}}
    with pytest.raises(HardwareError, match=r"no kernels for Tesla V100.*sm_70.*whl/cu126"):
        envinfo.require("v100x4", node)
    node["torch"]["arch_list"] = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]  # cu126
    assert envinfo.require("v100x4", node).name == "v100x4"


@pytest.mark.skipif(envinfo.torch_facts().get("devices"), reason="this machine has GPUs")
@pytest.mark.parametrize("argv", [
    ["train", "--strategy", "ddp", "--model", "tiny-llama", "--profile", "a100x4", "--nproc", "4"],
    ["preflight", "--profile", "v100x4"],
    ["notebooks", "run", "00_setup", "--profile", "h100x1", "--out", "build/never"],
])
def test_gpu_profile_without_gpus_is_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: profile ") and "--profile smoke" in err
    assert "Traceback" not in err


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
@pytest.mark.skipif(envinfo.torch_facts().get("devices"), reason="this machine has GPUs")
def test_gpu_profile_without_gpus_in_a_notebook_is_one_line(tmp_path):
    nb = nbk.build_notebook("GPU lab", ["from labkit.runtime.envinfo import require\nrequire(PROFILE)"])
    path = tmp_path / "gpu_lab.ipynb"
    nbformat.write(nb, path)
    run = nbk.run_notebook(path, profile="a100x4", out_dir=tmp_path / "out")
    assert not run.ok and run.ename == "HardwareError" and "--profile smoke" in run.evalue
    errors = [o for c in nbformat.read(run.output, as_version=4).cells if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert [e["traceback"] for e in errors] == [[f"HardwareError: {run.evalue}"]]


# ---------------------------------------------------------------- the preflight
def test_a_cpu_profile_has_no_lab_runs_to_size_and_its_preflight_lab_check_passes():
    # the manifest holds GPU profiles only (a CPU profile's runs are the notebooks' own in make test)
    from labkit.course import preflight

    for name in ("smoke", "smoke-bf16"):
        assert pc.lab_runs(get_profile(name)) == []
        checks = preflight.labs_checks(get_profile(name))
        assert [(c.status, c.detail.split(" suits")[0]) for c in checks] == [("ok", f"precision {get_profile(name).dtype}")]


@pytest.mark.slow
def test_preflight_smoke_trains_every_strategy_and_probes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "pf"
    proc = subprocess.run([sys.executable, "-m", "labkit", "preflight", "--profile", "smoke", "--json", "--out", str(out)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    checks = json.loads(proc.stdout)
    assert all({"strategy", "status", "seconds"} <= set(c) for c in checks)
    trained = {c["strategy"]: c["status"] for c in checks if c["kind"] == "strategy"}
    assert trained == dict.fromkeys(parallel.STRATEGIES, "ok")
    assert all(c["status"] == "ok" for c in checks)
    saved = json.loads((out / "preflight.json").read_text())
    assert saved["profile"] == "smoke" and len(saved["allreduce"]) == 1 and saved["run_id"].startswith("preflight-")
    assert saved["allreduce"][0]["ranks"] == [0, 1] and saved["allreduce"][0]["busbw_GBps"] > 0
    assert [m["rank"] for m in saved["matmul"]] == [0, 1] and all(m["tflops"] > 0 for m in saved["matmul"])
    assert saved["comm"] and (out / "comm_bench.json").is_file()  # the all-rank measurement, kept in OUT


# ---------------------------------------------------------------- lab04's holder check, any precision
@pytest.mark.parametrize("dtype, held", [("float32", 1.0), ("bfloat16", 0.5)])
def test_lab04_finds_the_grad_op_run_in_either_precision(dtype, held):
    from test_grading_units import _answer, _nb, _run

    from labkit.course.grading.evidence import Evidence
    from labkit.course.grading.nb_checks import lab04_fsdp as lab04

    full = 400 * 2**20
    runs = [_run("ddp", strategy="ddp", param_bytes=[full] * 4)]
    for key in lab04.FSDP_RUNS:  # everything else holds a quarter (its shard + one gathered unit)
        after = int(full * held) if key == "fsdp-grad-op" else full // 4
        runs.append(_run(key, strategy=key, memory={"param_bytes_after_forward": after},
                         sharding={"param_dtype": dtype}))
    ev = Evidence.from_notebook(_nb(*runs, _answer("04.holds_all_params", "fsdp-grad-op")))
    ok, why = lab04._holds_all(ev)
    assert ok, why
