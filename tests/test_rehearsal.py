"""Rehearsal (issue #25): every line a GPU profile runs has run before class, on CPU.

- The device layer (`labkit.runtime.device`) and the rehearsal's sizing (`labkit.runtime.rehearsal`), in process.
- Each notebook rehearsed for each profile in `REHEARSED` (parametrized over the notebooks that exist):
  it must run top to bottom, every record it shows is a rehearsal's, the node's calls are right (rank r
  on cuda:r, nccl groups, cuda meshes, fp32 really fp32), and the runs it makes are the manifest's
  (`labkit/data/lab_runs.json`, which `labkit.course.profile_check.lab_runs` reads).
- A GPU-only cell that raises, and a run the node cannot hold, fail a rehearsal in one line.
Adding a profile to `make test`'s rehearsal is one line: `REHEARSED`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import nbformat
import pytest
import torch

from labkit.runtime import allocator
from labkit.runtime import device as devices
from labkit.runtime import rehearsal
from labkit.course import notebooks as nbk
from labkit.course import rehearse
from labkit.errors import RehearsalError
from labkit.profiles import get_profile
from labkit.train import stand_in

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: The profiles `make test` rehearses, every notebook each (a100x1 is rehearsed by hand:
#: `make rehearse PROFILE=a100x1`). The free-GPU ones (issue #29: Colab's one T4, Kaggle's two) too: on t4x1
#: the six 2-GPU labs stop at their first cell (NeedsMoreGPUs, ~2 CPU s each), which is the whole of what
#: t4x1 runs in them; t4x2 runs every lab on 2 ranks in fp16. With warm kernels (tests/conftest.py) their
#: 12 notebooks beyond those that differ from the course profiles' cost ~4 minutes of one worker.
REHEARSED = ("a100x4", "h100x1", "v100x4", "t4x1", "t4x2")
EXECUTED = ROOT / "build" / "rehearsed"


@pytest.fixture
def rehearsing(monkeypatch, tmp_path):
    """This process rehearses (LABKIT_REHEARSE=1), logging to tmp_path; the stand-in is reset after."""
    log = tmp_path / "rehearsal.jsonl"
    for key, value in rehearse.environment(log).items():
        monkeypatch.setenv(key, value)
    devices.clear_calls()
    yield log
    devices.stop_standing_in()
    devices.clear_calls()


# ------------------------------------------------------------------------------------ the device layer
def test_rank_r_uses_cuda_r_and_a_rank_the_node_lacks_fails_as_on_the_node(rehearsing):
    a100x4 = get_profile("a100x4")
    assert devices.for_rank(a100x4, 3) == torch.device("cpu")  # the CPU stands in for cuda:3
    assert devices.is_gpu("cpu") and devices.logical("cpu") == "cuda:3"
    assert devices.calls("set_device")[-1]["device"] == "cuda:3"
    with pytest.raises(RuntimeError, match="invalid device ordinal.*cuda:1.*1 GPU"):  # finding 4
        devices.for_rank(get_profile("a100x1"), 1)
    assert [json.loads(line)["event"] for line in rehearsing.read_text().splitlines()] == ["set_device"]


def test_a_bare_cuda_device_is_the_current_one(rehearsing):
    # torch.device("cuda") on a node is the current device (cuda:0 unless a rank set its own)
    assert devices.resolve("cuda") == torch.device("cpu")
    assert devices.calls("set_device")[-1]["device"] == "cuda:0"
    devices.for_rank(get_profile("a100x4"), 2)
    devices.resolve("cuda")
    assert devices.calls("set_device")[-1]["device"] == "cuda:2"


def test_outside_a_rehearsal_cpu_is_cpu():
    assert not devices.standing_in() and not devices.is_gpu("cpu") and devices.is_gpu("cuda:0")
    assert devices.for_rank(get_profile("smoke"), 1) == torch.device("cpu")


def test_group_backend_is_nccl_and_mesh_and_model_agree_on_cuda(rehearsing):
    import torch.distributed as dist

    a100x4 = get_profile("a100x4")
    device, group = devices.join_group(a100x4, 0, 4, fake=True)
    try:
        model = devices.place(torch.nn.Linear(4, 4), device)
        mesh = devices.mesh(device, (4,))
        assert mesh.device_type == "cpu" and group is dist.group.WORLD
        (init,) = devices.calls("init_process_group")
        assert (init["backend"], init["device_id"], init["world_size"]) == ("nccl", "cuda:0", 4)
        assert devices.calls("mesh")[-1]["device_type"] == "cuda" == devices.calls("place")[-1]["device"][:4]
        # finding 2: a literal CPU mesh beside a model on cuda:r is the node's device mismatch -- here too
        from torch.distributed.device_mesh import init_device_mesh
        with pytest.raises(RuntimeError, match="'cpu' DeviceMesh.*cuda:0"):
            init_device_mesh("cpu", (4,))
        assert next(model.parameters()).device.type == "cpu"
    finally:
        devices.release_meshes()
        dist.destroy_process_group()


def test_an_fp32_baseline_is_fp32_on_the_gpu_cudnn_included():  # finding 8
    from labkit.train.loop import configure_backends
    from labkit.train.metrics import peak_tflops, tf32_enabled

    saved = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision,
             torch.backends.cudnn.rnn.fp32_precision, torch.backends.cudnn.benchmark)
    try:
        torch.backends.cudnn.conv.fp32_precision = "tf32"  # torch's default for cuDNN convolutions
        assert tf32_enabled()
        configure_backends(torch.device("cuda", 0))  # flags only: no CUDA call is made
        assert torch.backends.cudnn.conv.fp32_precision == "ieee" == torch.backends.cuda.matmul.fp32_precision
        assert not tf32_enabled() and torch.backends.cudnn.benchmark
        assert peak_tflops(torch.device("cpu"), "float32") == 0.0
    finally:
        (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision,
         torch.backends.cudnn.rnn.fp32_precision, torch.backends.cudnn.benchmark) = saved


def test_memory_history_is_switched_off_even_when_the_run_fails(monkeypatch, tmp_path):  # finding 1
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(("record", k)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    with pytest.raises(ValueError):
        with allocator.memory_history(torch.device("cuda", 0), tmp_path / "snap.pickle"):
            raise ValueError("the run failed")
    assert calls == [("record", {"max_entries": 100_000}), ("record", {"enabled": None})]


def test_each_run_hands_its_mesh_groups_back(rehearsing, tmp_path, monkeypatch):  # finding 16
    import torch.distributed as dist

    from labkit.train.api import make_config

    cfgs = [make_config(s, "tiny-llama", profile="smoke", nproc=2, out=str(tmp_path), progress=False)
            for s in ("tensor-fsdp", "fsdp-hybrid")]
    groups, real = [], devices.release_meshes

    def counting(keep=0):
        done = real(keep)
        if dist.is_initialized():
            groups.append(len(dist.distributed_c10d._world.pg_map))
        return done

    monkeypatch.setattr(devices, "release_meshes", counting)
    stand_in.launch(cfgs)
    assert groups[:2] == [1, 1]  # after each run of the launch: the world group only
    assert [c["event"] for c in devices.calls()] == ["run", "run"]  # sized; a CPU profile stands in for no GPU call


def test_a_gpus_memory_is_freed_by_a_full_collection_a_stand_ins_by_the_young_generations(rehearsing, monkeypatch):
    """An old cycle (a finished run's model, promoted to the oldest generation) holds device memory on a GPU:
    the full collection frees it. A stand-in for cuda:r (or a CPU) collects only the young generations: a full
    one walks the kernel's whole heap (0.3-1.5 CPU s with transformers imported) after every probe."""
    import gc
    import weakref

    from labkit.train.metrics import free_device_memory

    for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)

    class Cycle:  # as hooks and engines make them
        def __init__(self):
            self.me, self.weight = self, torch.zeros(4)

    def old_cycle():
        cycle = Cycle()
        gc.collect()  # it survives (still referenced): now in the oldest generation
        return weakref.ref(cycle)

    gc.disable()  # only the collections free_device_memory makes
    try:
        devices.for_rank(get_profile("a100x4"), 0)  # this process stands in for cuda:0
        stand_in_cycle = old_cycle()
        free_device_memory("cpu")
        assert stand_in_cycle() is not None  # left to the interpreter's next full collection
        devices.stop_standing_in()
        gpu_cycle = old_cycle()
        free_device_memory("cuda:0")
        assert gpu_cycle() is None and stand_in_cycle() is None
    finally:
        gc.enable()


# ------------------------------------------------------------------------------------ sizing at the real size
def _cfg(strategy, model, profile, **options):
    from labkit.train.config import from_dict
    return from_dict({"strategy": strategy, "model": model, "profile": profile, **options}).resolve()


def test_a_run_asking_for_gpus_the_node_lacks_fails_in_one_line(rehearsing):  # finding 4
    with pytest.raises(RehearsalError, match="asks for 2 GPUs, the node has 1; fix: use nproc"):
        stand_in.check_launch(_cfg("pipeline-gpipe", "tinyllama-1.1b", "a100x1", nproc=2))


def test_a_run_on_another_profile_than_the_notebooks_fails_the_rehearsal(rehearsing, monkeypatch):
    # 08's run_many without profile=PROFILE trained the smoke profile on every GPU node (found by rehearsing)
    monkeypatch.setenv(rehearsal.PROFILE_ENV, "a100x4")
    with pytest.raises(RehearsalError, match="trains on profile 'smoke', not the notebook's 'a100x4'.*profile=PROFILE"):
        stand_in.check_launch(_cfg("ddp", "tiny-llama", "smoke", nproc=2), profile_given=False)
    stand_in.check_launch(_cfg("ddp", "tinyllama-1.1b", "a100x4", nproc=4))
    stand_in.check_launch(_cfg("ddp", "tiny-llama", "smoke", nproc=2))  # asked for: 09's CPU ranks on one GPU
    with pytest.raises(RehearsalError, match="trains on profile 'v100x4'"):
        stand_in.check_launch(_cfg("ddp", "tinyllama-1.1b", "v100x4", nproc=4))
    monkeypatch.setenv(rehearsal.PROFILE_ENV, "smoke")  # a CPU notebook may train what it likes
    stand_in.check_launch(_cfg("ddp", "tiny-llama", "smoke-bf16", nproc=2))


def test_a_run_that_does_not_fit_is_the_nodes_cuda_oom(rehearsing):
    from labkit.course.profile_check import single_levers

    v100 = get_profile("v100x4")
    # finding 3: 09's dense single run, fp32 TinyLlama 8 x 512 without levers, on a 32 GB V100
    with pytest.raises(torch.OutOfMemoryError, match=r"single tinyllama-1.1b x1 \(amp none.*> 85% of the 32 GB"):
        stand_in.check_launch(_cfg("single", "tinyllama-1.1b", "v100x4", amp="none"))
    stand_in.check_launch(_cfg("single", "tinyllama-1.1b", "v100x4", amp="none",
                                **single_levers(v100, "tinyllama-1.1b", amp="none")))
    # finding 10: LoRA on Llama-2-7B at a100x4's 16 x 1024 under the 24 GB card's cap; micro-batches of 4 fit
    from labkit.train.memcap import scenario_cap_gb
    cap = scenario_cap_gb(get_profile("a100x4"), "llama2-7b")
    with pytest.raises(torch.OutOfMemoryError, match="lora llama2-7b"):
        stand_in.check_launch(_cfg("lora", "llama2-7b", "a100x4", checkpointing=True, memory_cap_gb=cap))
    stand_in.check_launch(_cfg("lora", "llama2-7b", "a100x4", checkpointing=True, memory_cap_gb=cap, accum=4))
    runs = rehearse.observed_runs(rehearsing)
    assert [r.fits for r in runs] == [False, True, False, True] and all(r.bytes for r in runs)


def test_a_stand_in_keeps_strategy_ranks_and_precision_and_shrinks_the_rest(rehearsing):
    cfg = _cfg("pipeline-1f1b", "tinyllama-1.1b", "v100x4", nproc=4, amp="none", microbatches=8)
    small = stand_in.stand_in(cfg)
    assert (small.run.strategy, small.world_size, small.precision.amp, small.optim.microbatches) == \
        ("pipeline-1f1b", 4, "none", 8)
    assert small.run.steps == rehearsal.STEPS and small.run.seq_len == rehearsal.SEQ_LEN
    assert cfg.optim.batch % small.optim.batch == 0 and small.optim.batch % 8 == 0
    from labkit.zoo.models import build_model, llm_config
    tiny = llm_config("tinyllama-1.1b")  # the same decoder layer, at most MAX_LAYERS of them, tiny widths
    assert (tiny.num_hidden_layers, tiny.num_attention_heads, tiny.num_key_value_heads) == (rehearsal.MAX_LAYERS, 32, 4)
    assert tiny.hidden_size == 32 * rehearsal.HEAD_DIM
    resnet = build_model("resnet50")
    assert [len(layer) for layer in (resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4)] == [3, 4, 6, 3]
    assert sum(p.numel() for p in resnet.parameters()) < 5_000_000


def test_deepspeed_fp16_runs_bf16_on_the_stand_in_and_the_record_says_so(rehearsing, monkeypatch):
    from deepspeed.accelerator import get_accelerator

    from labkit.parallel.zero import ds_config, stand_in_precision

    cfg = _cfg("zero2", "tinyllama-1.1b", "v100x4")
    assert cfg.precision.amp == "fp16"
    config = ds_config(cfg, 2, False, dp=4, hidden=2048, numel=10**9)
    assert stand_in_precision(config, "zero2") == (config, "")  # not standing in: the node's config as it is
    devices.for_rank(get_profile("v100x4"), 0)
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: False)  # this CPU: no oneDNN fp16
    runs, note = stand_in_precision(config, "zero2")
    assert (runs["fp16"]["enabled"], runs["bf16"]["enabled"], config["fp16"]["enabled"]) == (False, True, True)
    assert "zero2 ran bf16 in place of the node's fp16" in note
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    assert stand_in_precision(config, "zero2") == (config, "")  # fp16 where the CPU has it


@pytest.mark.parametrize("profile", REHEARSED + ("a100x1",))
def test_every_lab_run_of_the_manifest_fits_its_node_by_the_estimator(profile):
    """The runs the notebooks make on `profile` (observed by rehearsing them) at their real size: each fits
    the profile's headroom and GPU count, except a lesson's deliberate out-of-memory run (04's DDP)."""
    from labkit.train.config import from_dict

    checked = 0
    for row in rehearse.manifest_rows(profile):  # a run a lesson puts on smoke's CPU ranks names its profile
        prof = get_profile(row.get("profile", profile))
        cfg = from_dict({"strategy": row["strategy"], "model": row["model"], "profile": prof.name,
                         **row["options"]}).resolve()
        verdict = stand_in.size(cfg, prof)
        assert verdict["gpus_ok"], (row["lab"], row["label"], stand_in.describe(cfg))
        if not row.get("may_oom"):
            assert verdict["fits"], (row["lab"], row["label"], stand_in.describe(cfg), verdict)
            checked += verdict["bytes"] is not None
    assert checked >= 10
    if profile == "v100x4":  # 7B under FSDP: its sharded fp32 state alone is over a 32 GB V100's headroom
        labels = {(r["lab"], r["strategy"], r["model"]) for r in rehearse.manifest_rows(profile)}
        assert ("04_fsdp", "fsdp-offload", "llama2-7b") in labels and ("04_fsdp", "fsdp", "llama2-7b") not in labels
        seven_b = _cfg("fsdp", "llama2-7b", "v100x4", nproc=4, batch=4, seq_len=512, checkpointing=True)
        assert not stand_in.size(seven_b, get_profile("v100x4"))["fits"]


def test_spawn_on_a_gpu_profile_refuses_more_ranks_than_the_node_has_gpus():
    from labkit.course.exercises import ExerciseError, spawn

    with pytest.raises(ExerciseError, match="world=2.*'a100x1'.*1 GPU"):
        spawn(print, world=2, profile="a100x1")


def test_expect_reports_in_a_rehearsal_and_asserts_elsewhere(monkeypatch, capsys):
    with pytest.raises(AssertionError, match="DDP OOM"):
        rehearsal.expect(False, "DDP OOM, FSDP fits")
    monkeypatch.setenv(rehearsal.REHEARSE_ENV, "1")
    assert rehearsal.expect(False, "DDP OOM, FSDP fits") is False
    assert "not checked (numbers are not measurements): DDP OOM" in capsys.readouterr().out


def test_lab_09_allows_bf16_runs_the_same_loss_tolerance_as_lab_07():  # finding 11
    from labkit.course.grading.checks import losses_agree
    from labkit.course.grading.nb_checks.lab09_beyond_3d import LOSS_RTOL

    class Ev:
        def __init__(self, dtype):
            self.dtype = dtype

        def run(self, key):
            from types import SimpleNamespace
            return SimpleNamespace(losses=[2.0, 1.5] if key == "single" else [2.01, 1.51], dtype=self.dtype)

    assert losses_agree("interleaved", "single", LOSS_RTOL)(Ev("bfloat16"))[0]
    assert not losses_agree("interleaved", "single", LOSS_RTOL)(Ev("float32"))[0]


# ------------------------------------------------------------------------------------ notebooks
@pytest.mark.slow
def test_a_gpu_only_cell_that_raises_fails_the_rehearsal_in_one_line(tmp_path):
    """The cell smoke never takes: a GPU profile's rehearsal executes it and names it."""
    nb = nbk.build_notebook("GPU-only bug", [
        "from labkit.profiles import get_profile\nimport labkit.results as R\nfrom labkit.train import run\n"
        "profile = get_profile(PROFILE)\nGPU = profile.device == 'cuda'",
        "rec = run('ddp', profile.llm_model, profile=PROFILE, nproc=profile.nproc, steps=3, out='runs', stream=False)\n"
        "R.show(rec, key='ddp')\nR.answer('x', 1)",
        "if GPU:\n    raise RuntimeError('a line only the node runs')",
    ], metadata={"labkit": {"notebook": "gpu_bug"}})  # a course notebook, so grading gets past its identity
    path = tmp_path / "gpu_bug.ipynb"
    nbformat.write(nb, path)
    smoke = nbk.run_notebook(path, profile="smoke", out_dir=tmp_path / "smoke", rehearse=True)
    assert smoke.ok, smoke.describe()
    run = nbk.run_notebook(path, profile="a100x4", out_dir=tmp_path / "a100x4", rehearse=True)
    assert not run.ok and run.cell == 4 and "a line only the node runs" in run.describe()
    assert "\n" not in run.describe()
    executed = nbformat.read(run.output, as_version=4)
    from labkit.course.grading import evaluate, tamper
    assert tamper.rehearsed(executed) == "cell 4: run 'ddp'"  # grading refuses a rehearsal's results
    grade = evaluate.grade_notebook(executed, "gpu_bug", [])
    assert grade.status == evaluate.REHEARSAL and grade.score == 0
    shown = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs
             if "application/vnd.labkit+json" in o.get("data", {})]
    record = next(o for o in shown if "record" in o["data"]["application/vnd.labkit+json"])
    assert record["data"]["application/vnd.labkit+json"]["record"]["rehearsal"] is True
    assert "[rehearsal, not a measurement]" in record["data"]["text/plain"]


@pytest.mark.slow
def test_a_run_that_must_fit_fails_the_rehearsal_even_when_the_notebook_catches_it(tmp_path):
    nb = nbk.build_notebook("OOM", [
        "import torch\nfrom labkit.runtime.rehearsal import may_oom\nfrom labkit.train import run",
        "for strategy, expected in (('single', True), ('lora', False)):\n"
        "    try:\n        with may_oom(expected):\n"
        "            run(strategy, 'llama2-7b', profile=PROFILE, steps=2, out='runs', progress=False, "
        "memory_cap_gb=24.0, checkpointing=True)\n"
        "    except torch.OutOfMemoryError as exc:\n        print('out of memory:', exc)",
    ])
    path = tmp_path / "oom.ipynb"
    nbformat.write(nb, path)
    run = nbk.run_notebook(path, profile="a100x4", out_dir=tmp_path / "a100x4", rehearse=True)
    line = run.describe()
    assert not run.ok and run.cell == 3 and "\n" not in line
    assert "run lora llama2-7b x1" in line and "out of memory on the node" in line and "fix:" in line
    assert "run single" not in line  # the lesson's deliberate OOM is not a problem


def _rehearse(path: Path, profile: str) -> nbk.NotebookRun:
    return nbk.run_notebook(path, profile=profile, out_dir=EXECUTED / profile, rehearse=True)


CASES = [pytest.param(p, profile, id=f"{p.stem}-{profile}") for profile in REHEARSED for p in NOTEBOOKS]


@pytest.mark.slow
@pytest.mark.parametrize("path, profile", CASES)
def test_notebook_rehearses_on_the_profile(path, profile):
    run = _rehearse(path, profile)
    if not run.ok:
        pytest.fail(f"{run.describe()}\n{run.traceback[-3000:]}", pytrace=False)
    executed = nbformat.read(run.output, as_version=4)
    if run.status == "stopped":  # a 2-GPU lab on Colab's one T4 (labkit.runtime.hosted): one line, before any run
        _check_stopped(run, executed, profile)
        return
    shown = [p for p in _payloads(executed) if p["kind"] == "run"]
    assert all(p["record"]["rehearsal"] for p in shown)
    calls = rehearse.calls(run.rehearsal_log)
    prof = get_profile(profile)
    for call in calls:  # rank r uses cuda:r, never a GPU the node does not have
        if call["event"] == "set_device":
            assert call["device"] == f"cuda:{call['rank']}" and call["rank"] < prof.nproc, call
        if call["event"] == "init_process_group":
            assert call["backend"] == "nccl" and call["device_id"] == f"cuda:{call['rank']}", call
        if call["event"] == "mesh":
            assert call["device_type"] == "cuda", call
    observed = [r.row() for r in rehearse.observed_runs(run.rehearsal_log, run.cells())]
    manifest = [r for r in rehearse.manifest_rows(profile) if r["lab"] == path.stem]
    assert observed == manifest, (f"{path.stem} on {profile}: the runs changed; rehearse with --write-manifest "
                                  "(docs/gpu-node.md) and commit labkit/data/lab_runs.json")
    CHECKS.get(path.stem, lambda *a: None)(run, executed, calls, prof)


def _payloads(nb) -> list[dict]:
    from labkit.results import from_notebook
    return from_notebook(nb)


def _printed(executed) -> str:
    """Everything the executed notebook's code cells printed."""
    return "".join(o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", []))


def _check_02(run, executed, calls, prof):
    # the fp32 baseline trains with cuDNN's TF32 off (finding 8); the snapshot cell ran (finding 1)
    assert any(c["event"] == "configure" and c["fp32_precision"] == "ieee" for c in calls)
    assert any(c["event"] == "record_memory_history" for c in calls)


def _check_04(run, executed, calls, prof):
    # finding 2: the hand-made FSDP ranks (spawn) put the model on cuda:r and build a cuda mesh over nccl
    spawned = [c for c in calls if c["event"] == "place" and c.get("module") == "LlamaForCausalLM" and c["rank"] > 0]
    assert {c["device"] for c in spawned} >= {f"cuda:{r}" for r in range(1, prof.nproc)}


def _check_09(run, executed, calls, prof):
    # finding 15: the hang demo runs on 2 ranks on every profile: rank 0 in all_reduce, rank 1 in the barrier
    text = _printed(executed)
    stuck = [line for line in text.splitlines() if line.startswith("rank ") and ": waiting in" in line]
    assert len(stuck) == 2 and "all_reduce" in stuck[0] and "barrier" in stuck[1], stuck


def _check_06(run, executed, calls, prof):
    # issue 29: on a T4 without Llama-2-7B cached, the estimator's verdict and one line saying how to fetch it
    # (tests/test_t4_7b.py rehearses the fetched 7B); a 24 GB+ GPU's walk is the 7B's, one line says so
    text = _printed(executed)
    if prof.gpu_memory_gb < 24:
        assert "qlora llama2-7b x1" in text and "-> does not fit" in text, text[-2000:]
        assert "run `labkit fetch meta-llama/Llama-2-7b-hf` (a ~13.5 GB download" in text
    else:
        assert "Llama-2-7B on a 16 GB GPU: nothing to add" in text


CHECKS = {"02_single_gpu": _check_02, "04_fsdp": _check_04, "06_peft": _check_06, "09_beyond_3d": _check_09}


def _check_stopped(run, executed, profile):
    from labkit.runtime import hosted

    assert profile in hosted.MORE_GPUS and "Kaggle's T4 x2" in run.evalue, run.describe()
    assert "stopped" in run.describe() and "Kaggle" in nbk.format_runs([run])
    errors = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert [e["traceback"] for e in errors] == [[f"NeedsMoreGPUs: {run.evalue}"]]  # one line, no traceback
    assert rehearse.observed_runs(run.rehearsal_log) == [] == [
        r for r in rehearse.manifest_rows(profile) if r["lab"] == run.name]


def test_the_manifest_holds_every_rehearsed_profile_and_lab_runs_reads_it():
    from labkit.course import profile_check as pc

    manifest = rehearse.load_manifest()
    assert set(REHEARSED) | {"a100x1"} <= set(manifest)
    for name in manifest:
        runs = pc.lab_runs(get_profile(name))
        assert runs and all(len(r) == 5 and r[4]["nproc"] >= 1 for r in runs)
    v100 = {(lab, label) for lab, label, *_ in pc.lab_runs(get_profile("v100x4"))}
    assert ("09_beyond_3d", "single") in v100  # lab 09's dense run, which the hand-kept list missed
    for one_gpu in ("h100x1", "a100x1"):  # 09's multi-rank runs go to smoke's CPU ranks: not the GPU's runs
        multi = [r for r in rehearse.manifest_rows(one_gpu) if r["options"]["nproc"] > 1]
        assert multi and {(r["lab"], r.get("profile")) for r in multi} == {("09_beyond_3d", "smoke")}
        assert all(r[4]["nproc"] == 1 for r in pc.lab_runs(get_profile(one_gpu)))
    with pytest.raises(Exception, match="rehearse its notebooks once"):
        rehearse.manifest_rows("t4x9")


# ------------------------------------------------------------------------------------ bf16 over real ranks
#: What the smoke-bf16 notebook runs executed that neither a rehearsal nor another test does: bf16
#: training with real communication (a rehearsal runs rank 0 over the fake group, no communication)
#: for every strategy a lab trains in bf16 on several ranks. Covered elsewhere: fsdp bf16
#: (tests/test_fsdp.py's sweep), zero2 bf16 (tests/test_gpu_paths.py), single-rank bf16 (tests/test_train.py,
#: 02/06 in smoke: their AMP runs are bf16 on every profile). The a100x4 rehearsal takes every bf16
#: branch of the notebooks themselves, which replaced the smoke-bf16 notebook runs (tests/test_notebooks.py).
#: The launch is a user's, cold (`cold_launch`: no test hook, torchrun and ranks start as on a node), and it
#: holds one run of every strategy module that launches ranks (labkit.parallel.STRATEGIES; 'single' trains
#: in the caller's process): the suite's one cold launch of each strategy.
BF16_RANKS = 2
BF16_RUNS = [("ddp", {}), ("zero1", {}), ("zero3", {}), ("zero3-offload", {}), ("fsdp-grad-op", {}),
             ("tensor-fsdp", {}), ("pipeline-gpipe", {"microbatches": 4}), ("pipeline-1f1b", {"microbatches": 4}),
             ("pipeline-interleaved", {"microbatches": 4}), ("pipeline-zero-bubble", {"microbatches": 4}),
             ("context-parallel", {}), ("fsdp-qlora", {}), ("expert-parallel", {"model": "tiny-moe"}),
             ("lora", {}), ("qlora", {})]


def test_the_cold_launch_holds_every_strategy_module_that_launches_ranks():
    from labkit import parallel

    launched = {module for module, _ in parallel.STRATEGIES.values()} - {"single"}
    assert {parallel.STRATEGIES[name][0] for name, _ in BF16_RUNS} == launched


@pytest.mark.slow
def test_every_strategy_a_lab_trains_in_bf16_communicates_over_real_ranks(tmp_path, cold_launch):
    from labkit.train.many import run_many

    records = run_many(BF16_RUNS, "tiny-llama", nproc=BF16_RANKS, out=str(tmp_path), amp="bf16", steps=2,
                       batch=8, progress=False, stream=False)
    by_name = {f"{s}{'-' + o['model'] if 'model' in o else ''}": r for (s, o), r in zip(BF16_RUNS, records)}
    for name, rec in by_name.items():
        assert rec.dtype == "bfloat16" and rec.world_size == BF16_RANKS, name
        assert len(rec.losses) == 2 and all(map(math.isfinite, rec.losses)), (name, rec.losses)
    # Same weights and batch: every dense run's first loss (before any update) is DDP's, to bf16 precision
    # (lab 07's tolerance); after one step they may differ by what each strategy rounds in bf16.
    ref = by_name["ddp"].losses[0]
    for name, rec in by_name.items():
        if name not in ("ddp", "expert-parallel-tiny-moe", "fsdp-qlora", "qlora"):  # other model / quantized base
            assert rec.losses[0] == pytest.approx(ref, rel=0.02), (name, rec.losses[0], ref)


def test_the_t4_manifest_holds_the_free_gpu_lessons():
    """t4x1 runs no run of a 2-GPU lab; its 02 and 06 runs are t4x2's (06 never reads nproc); and on a 16 GB
    T4, 06's lesson holds at the real size (the full fine-tune runs out of memory, LoRA and QLoRA fit: a
    24 GB cap there would have hidden it)."""
    one, two = (rehearse.manifest_rows(p) for p in ("t4x1", "t4x2"))
    assert {r["lab"] for r in one} == {"02_single_gpu", "06_peft"}  # 00 and 01 make no training run
    assert [r for r in two if r["lab"] in ("02_single_gpu", "06_peft")] == one
    full, *_ = peft = [r for r in one if r["lab"] == "06_peft"]  # the full fine-tune first (shown as "full" if it fits)
    labels = {r["label"]: r for r in peft}
    assert full["model"] == "tinyllama-1.1b" and full["options"] == {"accum": 4, "memory_cap_gb": 16.0, "amp": "fp16",
                                                                     "nproc": 1}
    from labkit.train.config import from_dict

    def fits(row):
        cfg = from_dict({"strategy": row["strategy"], "model": row["model"], "profile": "t4x1", **row["options"]})
        return stand_in.size(cfg.resolve(), get_profile("t4x1"))["fits"]
    assert not fits(full) and full["may_oom"] and fits(labels["lora"]) and fits(labels["qlora"])
