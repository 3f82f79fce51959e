"""Issue 42's search criterion and the terms that moved it: context parallelism priced beyond its ring exchange
(the flash kernel at the length one ring step sees, the merge of partial outputs), the ZeRO stages of the row's
software in the search, and the count of published layouts the search ranks in its top 3 (asserted so it
cannot silently regress; bench/planner_heldout.py prints it). Pure Python; the search takes ~10 s."""
from __future__ import annotations

import dataclasses

import pytest

from labkit.errors import ConfigError
from labkit.parallel import hardware, perf_dp, perf_model, perf_ops, planner, published_runs

RUNS = {r.id: r for r in published_runs.runs()}
#: The last bench run: 15 of 16 (12 before CP's attention was priced, ZeRO-2 left out of Megatron-Core's searches
#: and its distributed optimizer striped over the node's NICs). The one left is explained in
#: docs/model_parallel.md (pipeline depth and the LM head).
TOP3 = 15
EXPLAINED = {"bridge-llama3-70b"}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("search")
    return {v["id"]: v for v in published_runs.search_verdicts(published_runs.runs(), folder)}


def test_the_search_ranks_the_published_best_in_its_top_3(verdicts):
    assert sum(v["ok"] for v in verdicts.values()) >= TOP3, {k: v["rank"] for k, v in verdicts.items()}
    assert {k for k, v in verdicts.items() if not v["ok"]} <= EXPLAINED
    assert verdicts["nemo-nemotron-340b"]["rank"] == 1  # issue 42: it recommended ZeRO-3 at 131 tokens/s/GPU
    assert verdicts["nemo-llama3-70b-cp2"]["rank"] <= 3  # CP=2 at 8K: CP tried below 16K tokens
    assert verdicts["bridge-llama3-8b-fsdp"]["rank"] <= 3  # was 4th behind ZeRO-2 and CP layouts
    assert verdicts["nemo-gpt3-20b"]["rank"] <= 3  # was 50th: its dp rings at one NIC each


def test_no_zero_2_in_a_megatron_core_search():
    req = planner.PlanRequest(model="llama2-7b", gpus=16, gpus_per_node=8, gpu="h100-sxm", batch=64,
                              zero_stages=published_runs.ZERO_STAGES["nemo2024"])
    p = planner.plan(req)
    assert {o.zero for o in p.fits + p.too_big} == {0, 1, 3}
    assert 2 in {o.zero for o in planner.plan(dataclasses.replace(req, zero_stages=(0, 1, 2, 3))).fits}
    with pytest.raises(ConfigError, match="zero_stages=.*0, 1, 3"):
        planner.PlanRequest(model="llama2-7b", gpus=8, gpus_per_node=8, zero_stages=(4,))


def test_cp_attention_runs_at_the_length_one_ring_step_sees():
    """Same keys per query, split over cp = 2: each kernel call sees s / 2 tokens, so the flash kernel runs at
    eta(s / 2) < eta(s) and the attention per query takes longer."""
    spec = RUNS["nemo-llama3-8b-cp2"].spec()
    rates = perf_ops.Rates(1e15, 1e15, 3e14, 2.6e12)
    whole = perf_ops.attention_s(spec, 1, 8192, 8192, 1, rates, True)
    half = perf_ops.attention_s(spec, 1, 8192, 4096, 1, rates, True)
    assert half > whole / 2
    assert half / (whole / 2) == pytest.approx((8192 / (8192 + 512)) / (4096 / (4096 + 512)), rel=1e-9)


def test_cp_merges_partial_outputs_through_hbm():
    spec = RUNS["nemo-llama3-8b-cp2"].spec()
    assert perf_ops.cp_merge_bytes(spec, 1, 1) == 0
    assert 0 < perf_ops.cp_merge_bytes(spec, 1, 2) < perf_ops.cp_merge_bytes(spec, 1, 4)
    assert perf_ops.cp_merge_bytes(spec, 2, 2) == pytest.approx(perf_ops.cp_merge_bytes(spec, 1, 2) / 2)


def test_a_cp_layout_computes_slower_than_the_same_gemms_without_cp():
    """dp 4 x cp 2 with micro-batch 2 runs the same GEMM shapes per GPU as dp 8 with micro-batch 1; before CP's
    attention was priced the two computed alike (only the exchange differed). NeMo's Llama 3 8B CP=2 row moves
    from +23 % towards its published rate."""
    run = RUNS["nemo-llama3-8b-cp2"]
    kw = dict(seq=run.seq, gpu=run.gpu, gpus_per_node=8, efficiency=hardware.default_efficiency(run.gpu, "fp8"))
    base = run.layout()
    cp = perf_model.step_time(run.spec(), dataclasses.replace(base, micro_batch=2, microbatches=16), **kw)
    flat = perf_model.step_time(run.spec(), dataclasses.replace(base, dp=8, cp=1, micro_batch=1,
                                                                microbatches=16), **kw)
    assert cp.matmul_s + cp.nonmatmul_s > (flat.matmul_s + flat.nonmatmul_s) * 1.02
    assert run.compare()["rel_err"] < 0.2


def test_megatron_core_s_distributed_optimizer_stripes_over_the_node_s_nics():
    """NeMo's GPT-3 20B: TP 2 leaves 4 dp ranks per node; Megatron-Core's bucketed reduce-scatter / all-gather run
    on their 4 NICs, not one (more bandwidth: faster, -24 % -> +14 %). DDP and DeepSpeed keep one NIC."""
    run = RUNS["nemo-gpt3-20b"]
    lay = run.layout()
    assert perf_dp.stripes(lay) and not perf_dp.stripes(dataclasses.replace(lay, zero=0))
    assert not perf_dp.stripes(RUNS["zero3-175b-384"].layout()) and not perf_dp.stripes(RUNS["bloom-176b"].layout())
    one_nic = dataclasses.replace(lay, dp_overlap=True, stack="megatron", pipeline_engine="deepspeed")
    kw = dict(seq=run.seq, gpu=run.gpu, gpus_per_node=8, efficiency=hardware.default_efficiency(run.gpu, "fp8"))
    striped, single = (perf_model.step_time(run.spec(), x, **kw) for x in (lay, one_nic))
    assert striped.dp_total_s < single.dp_total_s / 3 and striped.step_s < single.step_s
    assert abs(run.compare()["rel_err"]) < 0.2
