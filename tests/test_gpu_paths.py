"""CPU tests of the code around the GPU-only branches (issue 14: GPU-faithful runtime).

Every CUDA call these branches make is replaced by a recording stand-in, so the tests check what
is called, in which order and with what, and everything that does not need a GPU runs for real.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from labkit.train import batch_finder, metrics


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's memory / sync calls replaced by recorders: returns the list of (name, args)."""
    calls: list[tuple] = []
    for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, **k: calls.append((_n, a)))
    return calls


# ------------------------------------------------------------------------------ 19: peaks and MFU
@pytest.mark.parametrize("name, dtype, tf32, peak", [
    ("NVIDIA A100-SXM4-80GB", "float32", False, 19.5),
    ("NVIDIA A100 80GB PCIe", "float32", True, 156.0),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", False, 312.0),
    ("NVIDIA H100 80GB HBM3", "float32", False, 67.0),
    ("NVIDIA H100 80GB HBM3", "bfloat16", False, 989.0),
    ("NVIDIA H100 PCIe", "bfloat16", False, 756.0),
    ("NVIDIA H100 PCIe", "float32", False, 51.0),
    ("NVIDIA H100 NVL", "bfloat16", False, 835.0),
    ("Tesla V100-SXM2-32GB", "float16", False, 125.0),
    ("Tesla V100-PCIE-32GB", "float16", False, 112.0),
    ("Tesla V100-SXM2-32GB", "bfloat16", False, 0.0),  # no bf16 tensor cores: no peak, MFU 0
    ("NVIDIA GeForce RTX 4090", "bfloat16", False, 0.0),
])
def test_peak_table_matches_the_sku_and_uses_fp32_unless_tf32_is_on(name, dtype, tf32, peak):
    assert metrics.peak_for(name, dtype, tf32=tf32) == peak


def test_tf32_follows_torchs_matmul_and_cudnn_precision():
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.conv.fp32_precision
    try:
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        torch.set_float32_matmul_precision("highest")
        assert not metrics.tf32_enabled()
        torch.set_float32_matmul_precision("high")
        assert metrics.tf32_enabled()
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.conv.fp32_precision = "tf32"  # torch's default for cuDNN convolutions
        assert metrics.tf32_enabled()
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.conv.fp32_precision = before[1]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(5) for m in (nn.Linear(64, 64), nn.ReLU())], nn.Linear(64, 10))


def test_flops_of_a_compiled_model_are_counted_on_the_uncompiled_module():
    from torch.utils.flop_counter import FlopCounterMode

    model, x = _mlp(), torch.randn(8, 64)
    compiled = torch.compile(model)  # wrapping only: nothing is compiled until it is called
    counted = metrics.uncompiled_step_flops(compiled, [x, x])
    real = FlopCounterMode(display=False)
    with real:
        for _ in range(2):
            model(x).sum().backward()
    assert counted > 0
    # 3 x forward is the Kaplan estimate: an upper bound (the first layer has no input gradient)
    assert real.get_total_flops() <= counted <= 1.15 * real.get_total_flops()


def test_uncompiled_flops_leave_batchnorm_statistics_and_mode_alone():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    before = model[1].running_mean.clone()
    metrics.uncompiled_step_flops(torch.compile(model), [torch.randn(2, 3, 8, 8) + 5])
    assert torch.equal(model[1].running_mean, before) and model.training


# ------------------------------------------------------------------------------ 21: cudnn.benchmark
def test_cudnn_benchmark_is_switched_on_for_cuda_only(monkeypatch):
    from labkit.train.loop import configure_backends

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    configure_backends(torch.device("cpu"))
    assert torch.backends.cudnn.benchmark is False
    configure_backends(torch.device("cuda", 0))
    assert torch.backends.cudnn.benchmark is True
    assert torch.get_float32_matmul_precision() == "highest"  # fp32 stays fp32: MFU uses the fp32 peak


# ------------------------------------------------------------------------------ 6 / 17: batch finder
@pytest.mark.parametrize("message", [
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "CUDA error: out of memory",
])
def test_library_allocation_errors_count_as_out_of_memory(message):
    assert batch_finder.is_oom(RuntimeError(message))


def test_other_errors_are_not_out_of_memory():
    assert not batch_finder.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not batch_finder.is_oom(ValueError("out of memory"))  # only RuntimeErrors come from the device
    assert batch_finder.is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))


def _failing_above(monkeypatch, largest: int, exc: Exception) -> list:
    """Make the finder's probe step raise `exc` for micro-batches above `largest`; returns the batches tried."""
    real = batch_finder._probe_hook
    tried: list = []

    def probe_hook(*args, **kwargs):
        cfg, hook = real(*args, **kwargs)
        step = hook.train_step

        def train_step(micro, loss_fn):
            b = micro[0][0].shape[0]
            tried.append(b)
            if b > largest:
                raise exc
            return step(micro, loss_fn)

        hook.train_step = train_step
        return cfg, hook

    monkeypatch.setattr(batch_finder, "_probe_hook", probe_hook)
    return tried


def test_finder_treats_a_cublas_allocation_failure_as_the_boundary(monkeypatch):
    _failing_above(monkeypatch, 5, RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    report = batch_finder.find_max_batch("tiny-llama", budget_mb=10_000, limit=64)
    assert report["max_micro_batch"] == 5 and not report["limit_reached"]
    assert [b for b, peak in report["probes"] if peak is None] == [8, 6]  # doubling stops at 8, bisection 4..8


def test_finder_lets_other_errors_through(monkeypatch):
    _failing_above(monkeypatch, 1, RuntimeError("expected scalar type Float but found BFloat16"))
    with pytest.raises(RuntimeError, match="scalar type"):
        batch_finder.find_max_batch("tiny-llama", budget_mb=10_000, limit=64)


def test_finder_says_when_the_limit_and_not_the_memory_stopped_it(monkeypatch):
    tried = _failing_above(monkeypatch, 10_000, RuntimeError("never"))
    report = batch_finder.find_max_batch("tiny-llama", budget_mb=10_000, limit=8)
    assert report["max_micro_batch"] == 8 and report["limit_reached"] and report["limit"] == 8
    assert tried == [1, 2, 4, 8]
    assert batch_finder.DEFAULT_LIMIT >= 16384  # ResNet-50 on 80 GB runs out of memory below the cap


def test_the_cli_says_when_the_answer_is_only_a_lower_bound():
    from labkit.cli.train import format_batch_report

    report = {"model": "resnet50", "device": "cuda:0", "amp": "bf16", "checkpointing": False, "budget_bytes": None,
              "probes": [[2, 1], [4, 2]], "max_micro_batch": 4, "limit": 4, "limit_reached": True}
    assert "the true maximum is larger" in format_batch_report(report)
    assert "larger" not in format_batch_report({**report, "limit_reached": False})


def test_finder_frees_the_device_at_the_end(monkeypatch, fake_cuda):
    freed: list = []
    real = metrics.free_device_memory
    monkeypatch.setattr(batch_finder, "free_device_memory", lambda d, **k: freed.append((str(d), k)) or real(d, **k))
    batch_finder.find_max_batch("tiny-llama", budget_mb=10_000, limit=2)
    assert freed[-1] == ("cpu", {"reset_peak": True})  # after the search, the probe model released
    assert fake_cuda == []  # on CPU no CUDA call is made


def test_free_device_memory_on_cuda_empties_the_cache_and_resets_the_peak(fake_cuda):
    metrics.free_device_memory("cuda:0", reset_peak=True)
    assert [name for name, _ in fake_cuda] == ["synchronize", "empty_cache", "reset_peak_memory_stats"]
    fake_cuda.clear()
    metrics.free_device_memory("cuda:0")
    assert [name for name, _ in fake_cuda] == ["synchronize", "empty_cache"]


# ------------------------------------------------------------------------------ 4: runs of one launch
class _Cycle(nn.Module):
    """A model in a reference cycle (as hooks and engines make them): only gc.collect frees it."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1024))
        self.me = [self]


def test_runs_of_one_launch_start_clean(monkeypatch, fake_cuda):
    from types import SimpleNamespace

    from labkit.train import loop, many

    alive: list[weakref.ref] = []
    seen: list[tuple] = []

    def fake_train(cfg, ctx):
        # what the previous run left: its model must be collected and the CUDA peak reset by now
        seen.append((cfg, [r() is not None for r in alive], [name for name, _ in fake_cuda]))
        alive.append(weakref.ref(_Cycle()))

    monkeypatch.setattr(loop, "train", fake_train)
    gc.disable()  # the collection must come from the harness, not from the interpreter's thresholds
    try:
        many.train_all(["a", "b", "c"], SimpleNamespace(device=torch.device("cuda", 0)))
    finally:
        gc.enable()
    assert [s[1] for s in seen] == [[], [False], [False, False]]
    assert seen[1][2] == ["synchronize", "empty_cache", "reset_peak_memory_stats"]
    assert fake_cuda[-1][0] == "reset_peak_memory_stats"  # also after the last run


def test_free_gpu_memory_is_exported_for_notebooks(fake_cuda):
    import labkit

    labkit.free_gpu_memory()  # on CPU: a collection, no CUDA call
    assert fake_cuda == []


# ------------------------------------------------------------------------------ 5: pipeline chunk timing
class _FakeEvent:
    """A CUDA event stand-in: `record()` stamps a fake GPU time that runs `lag` s behind the CPU, as
    queued kernels do; elapsed_time is in milliseconds as torch.cuda.Event's."""

    gpu_now = 0.0

    def __init__(self):
        self.t = None

    def record(self, stream=None):
        self.t = _FakeEvent.gpu_now

    def elapsed_time(self, end) -> float:
        assert self.t is not None and end.t is not None, "an event was read before it was recorded"
        return (end.t - self.t) * 1e3


def test_cpu_clock_times_the_work_with_perf_counter():
    import time

    from labkit.train.timing import WorkClock

    clock = WorkClock("cpu")
    clock.begin_step()
    token = clock.start()
    t_mid = time.perf_counter()
    (t0, t1), = clock.end_step([clock.stop(token)])
    assert t0 <= t_mid <= t1


def test_cuda_clock_reads_events_once_at_the_end_on_the_origins_clock(fake_cuda, monkeypatch):
    import time

    from labkit.train.timing import WorkClock

    monkeypatch.setattr(time, "perf_counter", lambda: 100.0)  # the origin's wall time
    clock = WorkClock("cuda:0", event_factory=_FakeEvent)
    _FakeEvent.gpu_now = 5.0
    clock.begin_step()
    pending = []
    for work_s in (0.25, 0.5):  # two chunks back to back on the stream
        token = clock.start()
        _FakeEvent.gpu_now += work_s
        pending.append(clock.stop(token))
    assert [name for name, _ in fake_cuda] == ["synchronize"]  # nothing read (no sync) during the step
    times = clock.end_step(pending)
    assert [name for name, _ in fake_cuda] == ["synchronize", "synchronize"]
    assert times == [pytest.approx((100.0, 100.25)), pytest.approx((100.25, 100.75))]


def test_schedule_trace_records_chunks_through_the_clock():
    from types import SimpleNamespace

    from labkit.parallel.pipeline_trace import ScheduleTrace

    calls = []
    stage = SimpleNamespace(submod=nn.Linear(2, 2), device=torch.device("cpu"),
                            forward_one_chunk=lambda i, *a, **k: calls.append(("F", i)),
                            backward_one_chunk=lambda i, *a, **k: calls.append(("B", i)))
    trace = ScheduleTrace(stage)
    trace.begin_step()
    stage.forward_one_chunk(0)
    stage.forward_one_chunk(1)
    stage.backward_one_chunk(0)
    trace.end_step()
    stage.forward_one_chunk(2)  # not recording (evaluation)
    assert [(k, c) for k, c, _, _ in trace.steps[0]] == [("F", 0), ("F", 1), ("B", 0)]
    starts = [t0 for _, _, t0, _ in trace.steps[0]]
    assert starts == sorted(starts) and all(t1 >= t0 for _, _, t0, t1 in trace.steps[0])
    assert len(trace.steps) == 1 and len(calls) == 4


# ------------------------------------------------------------------------------ 7 / 17: measure
def test_bf16_lora_measurement_excludes_the_fp32_build():
    from labkit.memory.estimate import MemoryConfig
    from labkit.memory.measure import measure

    cfg = MemoryConfig(model="tiny-llama", precision="bf16", lora_rank=8, batch=2, seq=16)
    got = measure(cfg, device="cpu")
    fp32_copy = 4 * got.params  # what building in fp32 on the device would have held at once
    assert got.weights < 2.2 * got.params  # bf16 base (+ small adapters)
    assert got.weights < got.total < fp32_copy


def test_cuda_measurement_resets_the_peak_after_build_and_cast(monkeypatch):
    from labkit.memory import measure as M
    from labkit.memory import dry_run as T
    from labkit.memory.estimate import MemoryConfig

    log: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: log.append("base") or 1000)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: log.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: log.append("max") or 5000)
    real_build, real_loss, real_run = T.build, T._loss, M.run_step

    def build(cfg, **kw):
        out = real_build(cfg, **kw)
        log.append(("built", {p.dtype for p in out[0].parameters()}))
        return out

    monkeypatch.setattr(T, "build", build)
    monkeypatch.setattr(T, "_loss", lambda *a: log.append("step") or real_loss(*a))
    # the model itself stays on the CPU: everything but the allocator counters runs for real
    monkeypatch.setattr(M, "run_step", lambda cfg, device, **kw: real_run(cfg, device="cpu", **kw))
    got = M.measure(MemoryConfig(model="tiny-llama", precision="bf16", batch=2, seq=16), device="cuda:0")
    assert log == ["base", ("built", {torch.bfloat16}), "reset", "step", "max", "empty_cache"]
    assert got.total == 5000 - 1000


# ------------------------------------------------------------------------------ 12: GPU-stream time shares
def _x(name, cat, ts, dur, tid=1, pid=1, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _cuda_trace() -> dict:
    """One traced step (0..1000 us) in the shape torch.profiler's Chrome export writes on a GPU: CPU
    spans on the training thread (tid 1), CUDA runtime launches carrying a correlation id, and the
    device's events on stream rows (pid 0, tid = stream) with cat kernel / gpu_memcpy."""
    gpu = dict(pid=0, device=0)
    events = [
        _x("ProfilerStep#1", "user_annotation", 0, 1000),
        _x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "user_annotation", 0, 100),
        _x("cudaMemcpyAsync", "cuda_runtime", 40, 5, correlation=4),
        _x("aten::mm", "cpu_op", 110, 40),
        _x("cudaLaunchKernel", "cuda_runtime", 120, 5, correlation=1),
        _x("c10d::allreduce_", "cpu_op", 160, 30),
        _x("cudaLaunchKernel", "cuda_runtime", 170, 5, correlation=2),
        _x("Optimizer.step#AdamW.step", "user_annotation", 700, 100),
        _x("cudaLaunchKernel", "cuda_runtime", 710, 5, correlation=3),
        _x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 50, 20, tid=7, stream=7, correlation=4, **gpu),
        _x("ampere_sgemm_128x64_nn", "kernel", 100, 300, tid=7, stream=7, correlation=1, **gpu),
        _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", 300, 300,
           tid=20, stream=20, correlation=2, **gpu),
        _x("void at::native::(anonymous namespace)::multi_tensor_apply_kernel", "kernel", 720, 50, tid=7,
           stream=7, correlation=3, **gpu),
        {"ph": "i", "name": "[memory]", "pid": 1, "tid": 1, "ts": 130, "s": "t",
         "args": {"Device Type": 1, "Device Id": 0, "Addr": 1, "Bytes": 4096, "Total Allocated": 4096}},
    ]
    return {"traceEvents": events}


def test_cuda_trace_shares_come_from_the_gpu_streams():
    from labkit.profiling.traces import CATEGORIES, time_breakdown

    got = time_breakdown(_cuda_trace())
    assert got["source"] == "gpu streams"
    # compute 100-400; NCCL alone 400-600 (exposed); optimizer kernel 720-770; the input copy and the
    # idle GPU while the CPU loaded data 0-100; the rest idle
    assert got["shares"] == pytest.approx({"compute": 0.3, "communication": 0.2, "data loading": 0.1,
                                           "optimizer": 0.05, "other": 0.35})
    assert set(got["shares"]) == set(CATEGORIES) and sum(got["shares"].values()) == pytest.approx(1.0)
    gpu = got["gpu"]
    assert gpu["communication busy"] == pytest.approx(0.3)
    assert gpu["overlapped communication"] == pytest.approx(0.1)  # 300-400, hidden behind the GEMM
    assert gpu["exposed communication"] == pytest.approx(0.2)
    assert got["thread_shares"]["compute"] > 0  # the training thread's view is still there


def test_cpu_traces_keep_the_training_thread_shares():
    from labkit.profiling.traces import time_breakdown

    trace = _cuda_trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("pid") != 0]
    got = time_breakdown(trace)
    assert got["source"] == "training thread" and "gpu" not in got
    assert got["shares"] == got["thread_shares"]


def test_the_summary_of_a_cuda_trace_reports_exposed_communication(tmp_path):
    import json

    from labkit.profiling import profiler as profiling

    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_cuda_trace()))
    summary = profiling.summarize(path)
    assert summary.bottleneck == "other"  # the GPU idled most: launch-bound, not compute-bound
    assert "time share of the GPU" in summary.text and "20.0 % exposed" in summary.text
    assert "10.0 % hidden behind compute" in summary.text


# ------------------------------------------------------------------------------ 9 / 21: DeepSpeed
def _ds_config(strategy="zero2", *, model="tiny-llama", **kw):
    from labkit.parallel import zero
    from labkit.train.api import make_config

    cfg = make_config(strategy, model, nproc=2, **{k: v for k, v in kw.items() if k == "amp"})
    stage, offload = zero.VARIANTS[strategy]
    return zero.ds_config(cfg, stage, offload, dp=2, hidden=64, numel=100_000,
                          **{k: v for k, v in kw.items() if k != "amp"})


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_overlap_comm_is_on_for_gpu_runs_only(strategy):
    assert _ds_config(strategy, gpu=True)["zero_optimization"]["overlap_comm"] is True
    assert _ds_config(strategy, gpu=False)["zero_optimization"]["overlap_comm"] is False


def test_vision_runs_cast_buffers_with_the_parameters():
    assert _ds_config(amp="bf16", cast_buffers=True)["data_types"] == {"buffer_dtype": "bf16"}
    assert _ds_config(amp="fp16", cast_buffers=True)["data_types"] == {"buffer_dtype": "fp16"}
    assert "data_types" not in _ds_config(amp="bf16")  # LLMs: rotary inv_freq stays fp32
    assert "data_types" not in _ds_config(cast_buffers=True)  # fp32: nothing to cast


def test_zero_casts_float_inputs_to_the_engine_dtype_and_never_labels():
    from types import SimpleNamespace

    from labkit.parallel.zero import ZeroStrategy

    hook = ZeroStrategy.__new__(ZeroStrategy)
    hook.engine = SimpleNamespace(get_data_types=lambda: (torch.bfloat16, torch.bfloat16))
    assert hook._cast_inputs(torch.zeros(2, 3, 4, 4)).dtype == torch.bfloat16
    tokens = torch.zeros(2, 8, dtype=torch.long)
    assert hook._cast_inputs(tokens) is tokens
    hook.engine = SimpleNamespace(get_data_types=lambda: (torch.float32, torch.float32))
    images = torch.zeros(2, 3)
    assert hook._cast_inputs(images) is images


@pytest.mark.slow
def test_zero2_bf16_trains_a_resnet_on_two_ranks(tmp_path):
    from labkit.train.api import run

    record = run("zero2", "tiny-resnet", nproc=2, steps=3, amp="bf16", out=str(tmp_path), progress=False,
                 stream=False)
    assert record.dtype == "bfloat16" and record.world_size == 2 and len(record.losses) == 3
    assert all(0 < loss < 20 for loss in record.losses) and record.train.flops_per_step > 0


# ------------------------------------------------------------------------------ 1: buffers under FSDP offload
def test_place_buffers_moves_persistent_and_rotary_buffers_but_not_parameters():
    from labkit.parallel import loading

    model = loading.build_on_rank0("tiny-llama", rank=0, seed=0)
    non_persistent = {n for m in model.modules() for n in m._non_persistent_buffers_set}
    assert "inv_freq" in non_persistent  # the rotary buffer no state dict carries
    loading.place_buffers(model, torch.device("meta"))  # stands in for cuda: any device but the params'
    assert all(b.device.type == "meta" for b in model.buffers())
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert {n for m in model.modules() for n in m._non_persistent_buffers_set} == non_persistent


def _offload_load(out_dir: str) -> dict:
    """On each of 2 CPU ranks: rank-0 loading into an FSDP2 model with CPUOffloadPolicy (the fsdp-offload
    start); the rotary buffers and a parameter shard, as lists."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from labkit.parallel import loading

    rank = dist.get_rank()
    model = loading.build_on_rank0("tiny-llama", rank, seed=0)
    full = loading.full_state_on_rank0(model, rank)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    loading.load_sharded_from_rank0(model, full, group=dist.group.WORLD, device=torch.device("cpu"),
                                    buffers_on=torch.device("cpu"))
    buffers = {n: b for n, b in model.named_buffers()}
    return {"buffers": {n: b.tolist() for n, b in buffers.items()},
            "devices": sorted({b.device.type for b in buffers.values()}),
            "meta_left": loading.has_meta(model)}


@pytest.mark.slow
def test_offloaded_fsdp_start_gives_every_rank_rank0s_rotary_buffers(tmp_path_factory):
    from _reference import spawn_two_ranks

    r0, r1 = spawn_two_ranks(_offload_load, tmp_path_factory, "offload-buffers")
    assert any("inv_freq" in n for n in r0["buffers"])
    assert r1["buffers"] == r0["buffers"]  # rank 1 allocated them empty: the values came from rank 0
    assert r0["devices"] == r1["devices"] == ["cpu"] and not r1["meta_left"]


# ------------------------------------------------------------------------------ 21: weak vs strong scaling
def _scaling_run(ranks: int, global_batch: int, samples_per_s: float):
    from labkit.results import RunRecord

    return RunRecord(strategy="ddp", model="resnet50", profile="a100x4", world_size=ranks, steps=10,
                     losses=[1.0], step_time_s=global_batch / samples_per_s, samples_per_s=samples_per_s,
                     peak_bytes=[1] * ranks, param_bytes=[1] * ranks, grad_bytes=[1] * ranks,
                     optimizer_bytes=[1] * ranks, trainable_params=1, device="cuda", dtype="bfloat16",
                     global_batch=global_batch)


def test_scaling_is_labelled_strong_or_weak_and_nvidias_point_weak():
    from labkit.viz import report

    strong = [_scaling_run(1, 256, 1000.0), _scaling_run(4, 256, 3000.0)]
    weak = [_scaling_run(1, 256, 1000.0), _scaling_run(4, 1024, 3600.0)]
    assert report.scaling_kind(strong) == "strong" and report.scaling_kind(weak) == "weak"
    assert report.scaling_kind([_scaling_run(1, 256, 1.0), _scaling_run(2, 384, 1.0)]) == "mixed"
    assert {row["scaling"] for row in report.scaling_rows(strong)} == {"strong"}
    mine, theirs = report.scaling_labels(strong)
    assert mine.startswith("measured: strong scaling (fixed global batch)")
    assert "weak scaling (256 img per GPU)" in theirs and "84%" in theirs


def test_the_scaling_chart_says_which_kind_each_line_is():
    from labkit.viz import report

    fig = report.scaling_chart([_scaling_run(1, 256, 1000.0), _scaling_run(4, 256, 3000.0)])
    texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("strong scaling" in t for t in texts) and any("weak scaling" in t for t in texts)
