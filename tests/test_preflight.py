"""`labkit preflight` (issue 25, findings 5, 6, 9; the preflight side of 14): safe to run twice in one folder,
fails on slow links and slow GPUs, trains every (strategy, precision, variant) the labs use. The GPU probes
need CUDA; everything around them runs here on injected measurements, no process started."""
from __future__ import annotations

import pytest

from labkit import results
from labkit.course import node_probes, preflight, profile_check
from labkit.errors import LaunchError
from labkit.facts import TrainFacts
from labkit.profiles import get_profile
from labkit.profiling import commbench

A100 = get_profile("a100x4")


def _record(run_id: str, strategy: str = "ddp", losses=(2.0, 1.5)) -> results.RunRecord:
    return results.RunRecord(strategy=strategy, model="tinyllama-1.1b", profile="a100x4", world_size=4, steps=2,
                             losses=list(losses), step_time_s=0.1, samples_per_s=1.0, peak_bytes=[1] * 4,
                             param_bytes=[0] * 4, grad_bytes=[0] * 4, optimizer_bytes=[0] * 4, trainable_params=1,
                             device="cuda", dtype="bfloat16", timestamp="2026-11-25T01:00:00+00:00",
                             train=TrainFacts(run_id=run_id))


# ---------------------------------------------------------------- finding 5: a second preflight, same folder
def test_a_second_preflight_reads_only_its_own_records_and_probes(tmp_path, monkeypatch):
    yesterday, today = preflight.new_run_id(), preflight.new_run_id()
    assert yesterday != today and today.startswith("preflight-")
    plan = [("ddp", {"model": "tinyllama-1.1b", "run_id": f"{rid}-00-ddp"}) for rid in (yesterday,)]
    results.append(_record(plan[0][1]["run_id"]), tmp_path)  # yesterday's run finished: its record is in OUT
    (tmp_path / preflight.PROBES_FILE).write_text('{"run_id": "%s", "allreduce": [], "matmul": []}' % yesterday)

    def launch_dies(*args, **kwargs):  # today's launch dies before any run records anything
        raise LaunchError("rank 2: NCCL error: unhandled system error")

    monkeypatch.setattr("labkit.train.many.run_many", launch_dies)
    runs = [("ddp", {"model": "tinyllama-1.1b", "run_id": f"{today}-00-ddp"}),
            ("fsdp", {"model": "tinyllama-1.1b", "run_id": f"{today}-01-fsdp", "amp": "bf16"})]
    common = dict(profile="a100x4", steps=3, out=str(tmp_path))
    checks = preflight._train_many(A100, runs, common, tmp_path, today)
    assert [(c.strategy, c.status) for c in checks] == [("ddp", "failed"), ("fsdp", "failed")]  # not yesterday's "ok"
    assert "NCCL error" in checks[0].detail and "--amp bf16" in checks[1].fix
    assert preflight.load_probes(tmp_path, today) is None  # yesterday's probes do not pass for today's
    [line] = preflight.probe_checks(None, A100)
    assert line.status == "failed" and "from this preflight" in line.detail


def test_every_run_recorded_then_a_failed_teardown_is_one_line_not_an_index_error(tmp_path, monkeypatch):
    today = preflight.new_run_id()
    runs = [(s, {"model": "tinyllama-1.1b", "run_id": f"{today}-{i:02d}-{s}"}) for i, s in enumerate(("ddp", "fsdp"))]

    def records_then_dies(pending, *args, **kwargs):
        for name, own in pending:
            results.append(_record(own["run_id"], name), tmp_path)
        raise LaunchError("rank 0 exited with code 1 after the last run")

    monkeypatch.setattr("labkit.train.many.run_many", records_then_dies)
    checks = preflight._train_many(A100, runs, dict(profile="a100x4", steps=3, out=str(tmp_path)), tmp_path, today)
    assert [(c.strategy, c.status) for c in checks] == [("ddp", "ok"), ("fsdp", "ok"), ("launch", "failed")]


# ---------------------------------------------------------------- finding 6: probes judged on injected numbers
def _probes(pairs: dict, tflops: list[float], device="NVIDIA A100 80GB PCIe", comm_busbw=None, dtype="bfloat16"):
    rows = [{"ranks": list(p), "bytes": 2**28, "seconds": 0.01, "algbw_GBps": bw, "busbw_GBps": bw}
            for p, bw in pairs.items()]
    comm = [] if comm_busbw is None else [{"op": "all_reduce", "bytes": 2**30, "seconds": 0.1, "algbw_gbps": 1.0,
                                           "busbw_gbps": comm_busbw, "world_size": 4, "backend": "nccl"}]
    matmul = [{"rank": r, "n": 8192, "dtype": dtype, "seconds": 0.004, "tflops": t, "device": device}
              for r, t in enumerate(tflops)]
    return {"run_id": "x", "allreduce": rows, "comm": comm, "matmul": matmul}


def _status(checks):
    return {c.strategy: c.status for c in checks}


def test_pcie_pairs_pass_at_pcie_speed_and_fail_far_below_it():
    # PCIe 4.0 x16: 31.5 GB/s per direction x 0.75 = 23.6 GB/s expected; the bar is half of it.
    topo = {(0, 1): "NODE", (0, 2): "SYS", (1, 2): "SYS"}
    checks = preflight.probe_checks(_probes({(0, 1): 21.0, (0, 2): 19.5, (1, 2): 6.0}, [240.0] * 3), A100, topo)
    assert _status(checks) == {"all-reduce 0-1": "ok", "all-reduce 0-2": "ok", "all-reduce 1-2": "failed",
                               "matmul 0": "ok", "matmul 1": "ok", "matmul 2": "ok"}
    bad = next(c for c in checks if c.strategy == "all-reduce 1-2")
    assert "< 50% of 23.6 GB/s expected (PCIe 4.0 x16" in bad.detail and "nvidia-smi topo -m" in bad.fix


def test_a_pair_on_pcie_where_the_topology_shows_nvlink_fails():
    # NV12 (an NVLink bridge or NVSwitch): 12 x 25 GB/s x 0.75 = 225 GB/s; a pair measured at PCIe speed --
    # NVLink down, or NCCL_P2P_DISABLE set -- is far below half of it.
    checks = preflight.probe_checks(_probes({(0, 1): 21.0, (2, 3): 205.0}, []), A100, {(0, 1): "NV12", (2, 3): "NV12"})
    assert _status(checks) == {"all-reduce 0-1": "failed", "all-reduce 2-3": "ok"}
    # HGX A100 4-GPU boards join each pair with 4 links: 75 GB/s expected (nccl-tests reports ~72 p2p).
    [nv4] = preflight.probe_checks(_probes({(0, 1): 70.0}, []), A100, {(0, 1): "NV4"})
    assert nv4.status == "ok" and "75.0 GB/s expected (4 NVLink" in nv4.detail


def test_a_profile_that_expects_nvlink_fails_a_pcie_pair(monkeypatch):
    monkeypatch.setitem(node_probes.BARS, "a100x4", node_probes.Bar("nvlink"))
    checks = preflight.probe_checks(_probes({(0, 1): 22.0, (0, 2): 200.0}, []), A100, {(0, 1): "SYS"})
    assert _status(checks) == {"all-reduce 0-1": "failed", "all-reduce 0-2": "ok"}  # 0-2: topology unknown -> NVLink
    assert "expects NVLink" in checks[0].detail
    # Without the topology, a profile that expects NVLink holds every pair to the card's full link count.
    [slow] = preflight.probe_checks(_probes({(0, 1): 22.0}, []), A100, {})
    assert slow.status == "failed" and "225.0 GB/s expected (12 NVLink" in slow.detail


def test_a_throttled_gpu_fails_its_matmul_and_the_form_factor_sets_the_bar():
    # A100 PCIe: 252.9 TFLOPS achievable (bf16); 70 % of it is 177. A GPU held at low clocks reaches ~half.
    matmul = [c for c in preflight.probe_checks(_probes({}, [241.0, 238.5, 121.0, 240.2]), A100)
              if c.strategy.startswith("matmul")]
    assert [c.status for c in matmul] == ["ok", "ok", "failed", "ok"]
    assert "GPU 2" in matmul[2].detail and "clocks-event reasons" in matmul[2].fix
    [_, sxm] = preflight.probe_checks(_probes({}, [185.0], device="NVIDIA A100-SXM4-80GB"), A100)
    assert sxm.status == "failed" and "271.2 TFLOPS expected (A100 SXM" in sxm.detail  # 185 < 0.7 x 271.2
    [_, fp32] = preflight.probe_checks(_probes({}, [19.0], dtype="float32"), A100)
    assert fp32.status == "ok"  # an fp32 probe is not held to the tensor-core number
    v100 = get_profile("v100x4")
    [_, volta] = preflight.probe_checks(_probes({}, [60.0], device="Tesla V100-SXM2-32GB", dtype="float16"), v100)
    assert volta.status == "failed" and "95.0 TFLOPS" in volta.detail


def test_the_all_gpu_ring_is_held_to_its_slowest_link():
    topo = {(0, 1): "NV12", (0, 2): "SYS", (1, 2): "SYS"}
    pairs = {(0, 1): 205.0, (0, 2): 21.0, (1, 2): 21.0}
    ok = _status(preflight.probe_checks(_probes(pairs, [], comm_busbw=19.0), A100, topo))
    slow = _status(preflight.probe_checks(_probes(pairs, [], comm_busbw=4.0), A100, topo))
    assert ok["all-reduce x4"] == "ok" and slow["all-reduce x4"] == "failed"


def test_cpu_profiles_are_measured_not_judged():
    checks = preflight.probe_checks(_probes({(0, 1): 0.3}, [0.02, 0.02], device="cpu", dtype="float32",
                                            comm_busbw=0.1), get_profile("smoke"))
    assert all(c.status == "ok" and "expected" not in c.detail for c in checks) and len(checks) == 4


def test_topology_is_read_per_rank_from_nvidia_smi():
    text = """\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV12\tNODE\tSYS\tPXB\t0-31\t0\t\tN/A
GPU1\tNV12\t X \tNODE\tSYS\tPXB\t0-31\t0\t\tN/A
GPU2\tNODE\tNODE\t X \tNV12\tSYS\t0-31\t0\t\tN/A
GPU3\tSYS\tSYS\tNV12\t X \tSYS\t32-63\t1\t\tN/A
NIC0\tPXB\tPXB\tSYS\tSYS\t X

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks"""
    cells = node_probes.parse_topology(text)
    assert cells == {(0, 1): "NV12", (0, 2): "NODE", (0, 3): "SYS", (1, 2): "NODE", (1, 3): "SYS", (2, 3): "NV12"}
    assert node_probes.rank_topology(text, 2, visible="2,3") == {(0, 1): "NV12"}  # ranks 0, 1 = GPUs 2, 3
    assert node_probes.rank_topology(text, 4, visible="") == cells
    assert node_probes.parse_topology("") == {}


# ---------------------------------------------------------------- finding 9: every variant the labs run
@pytest.mark.parametrize("name, half", [("a100x4", "bf16"), ("v100x4", "fp16")])
def test_every_strategy_precision_and_variant_of_the_labs_trains(name, half):
    profile = get_profile(name)
    plan = preflight.runs_for(profile)
    keys = {(s, m, tuple(sorted(o.items()))) for s, m, o in plan}
    assert len(keys) == len(plan)  # each variant once
    amp = profile_check.AMP_OF_DTYPE[profile.dtype]
    for lab, label, strategy, model, options in profile_check.lab_runs(profile):
        own = {k: v for k, v in options.items() if k != "nproc" and v not in (None, False)}
        own["amp"] = own.get("amp") or amp
        assert (strategy, model, tuple(sorted(own.items()))) in keys, f"{lab} {label} does not train in the preflight"
    variants = {(s, o["amp"]) for s, _m, o in plan}
    assert {("fsdp", "none"), ("fsdp", half), ("ddp", "none"), ("ddp", half), ("zero3", half)} <= variants
    capped = {s for s, _m, o in plan if o.get("memory_cap_gb")}
    assert {"lora", "qlora"} <= capped  # 06 runs them under its 24 GB cap


# ---------------------------------------------------------------- finding 14: the comm file notebook 03 reads
def test_the_comm_file_notebook_03_reads_is_checked_on_a_gpu_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_RUNS", str(tmp_path))
    own = _probes({}, [], comm_busbw=20.0)
    [none] = preflight.comm_file_check(A100, own)
    assert none.status == "ok" and "nominal link speeds" in none.detail
    short = [commbench.measurement("all_reduce", 16 * 2**20, 0.004, 2, "nccl")]  # the old defaults: 2 ranks, 16 MiB
    commbench.save(short, tmp_path, warmup=1, iters=2)
    [bad] = preflight.comm_file_check(A100, own)
    assert bad.status == "failed" and "2 of 4 GPUs" in bad.detail and "16 MiB" in bad.detail
    assert "labkit bench comm" in bad.fix
    good = [commbench.measurement("all_reduce", 2**30, 2**30 / 13e9, 4, "nccl")]  # 13 GB/s algbw = 19.5 busbw
    commbench.save(good, tmp_path, warmup=1, iters=2)
    [fine] = preflight.comm_file_check(A100, own)
    assert fine.status == "ok" and "what notebook 03 uses" in fine.detail
    assert preflight.comm_file_check(get_profile("smoke"), own) == []


# ------------------------------------------------------- --strategies: the slice `make gpu-check` runs
def test_a_strategies_slice_trains_only_their_runs_and_an_unknown_name_lists_the_valid_ones(tmp_path, monkeypatch):
    from labkit.cli.preflight import chosen_strategies
    from labkit.errors import ConfigError

    launched = []

    def launch_dies(runs, *args, **kwargs):  # what would be trained, without starting ranks
        launched.append([own["run_id"].rsplit("-", 1)[-1] for _, own in runs])
        raise LaunchError("stopped by the test")

    monkeypatch.setattr("labkit.train.many.run_many", launch_dies)
    checks = preflight.run("smoke", out=tmp_path, steps=2, strategies=("ddp",))
    assert launched == [["ddp"]]
    assert {c.strategy for c in checks if c.kind == "strategy"} == {"ddp"}  # no `single` run in this process
    assert chosen_strategies("h100x1", "ddp, fsdp") == ("ddp", "fsdp") and chosen_strategies("h100x1", None) is None
    with pytest.raises(ConfigError, match="'dpp'.*ddp, fsdp"):
        chosen_strategies("h100x1", "dpp")
