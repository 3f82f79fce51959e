"""Checks of notebooks/04_fsdp.ipynb: DDP vs the FSDP sharding strategies, and the exercises on them.

Answers about a run are checked against the student's own recorded run (grading never re-runs a GPU);
the rest against what labkit computes (`labkit.memory.estimate`, `labkit.parallel.fsdp`).
"""
from __future__ import annotations

from labkit.facts import MemoryFacts, ShardingFacts
from labkit.course.grading.checks import (answer_close, answer_equals, bytes_below, cell_ran, figure_present,
                                   losses_agree, relation)
from labkit.course.grading.evidence import CheckFailed, Evidence

NOTEBOOK = "04_fsdp"
#: The runs of section 2 that shard with FSDP (keys as the notebook shows them).
FSDP_RUNS = ("fsdp", "fsdp-grad-op", "fsdp-no-shard", "fsdp-hybrid", "fsdp-offload")


def param_ratio(ev: Evidence) -> float:
    return ev.run("fsdp").param_bytes[0] / ev.run("ddp").param_bytes[0]


def llama7b_full_shard_8(ev: Evidence) -> float:
    # FULL_SHARD = ZeRO-3: 16 B per parameter (mixed-precision AdamW) divided over the 8 ranks.
    from labkit.memory.estimate import MemoryConfig, estimate

    cfg = MemoryConfig.for_fsdp("full_shard", model="llama2-7b", precision="mixed-bf16", dp=8)
    return estimate(cfg).model_states / 1e9


def comm_vs_ddp(ev: Evidence) -> float:
    # ZeRO paper Sec. 7.2.2: all-gather in forward + in backward + reduce-scatter = 1.5x DDP's all-reduce.
    from labkit.parallel.ddp import allreduce_seconds
    from labkit.parallel.fsdp import VARIANTS, comm_bytes_per_step

    psi, ranks = 10**9, 8
    full_shard = sum(comm_bytes_per_step(VARIANTS["fsdp"], psi, (ranks,)).values())
    return full_shard / allreduce_seconds(psi, ranks, 1.0)["bytes_sent_per_rank"]


def offload_host_bytes(ev: Evidence) -> float:
    return float(ev.run("fsdp-offload").cpu_offload_bytes[0])


def offload_physical(ev: Evidence) -> bool:
    return bool(ev.run("fsdp-offload").memory.offload_physical)


def distributed_type(ev: Evidence) -> str:
    return str(ev.run("accelerate").accelerate.distributed_type)


#: Bytes per element of the gathered (unsharded) parameters by MixedPrecisionPolicy param_dtype.
_GATHERED_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _holds_all(ev: Evidence):
    # Measured, not memorised: the FSDP runs whose params between forward and backward were the full model.
    # A run whose MixedPrecisionPolicy gathers bf16/fp16 holds half of ddp's fp32 bytes yet all params.
    full = ev.run("ddp").param_bytes[0]
    memory = {k: ev.run(k).memory or MemoryFacts() for k in FSDP_RUNS}
    dtype = {k: (ev.run(k).sharding or ShardingFacts()).param_dtype for k in FSDP_RUNS}
    holders = sorted(k for k in FSDP_RUNS if (memory[k].param_bytes_after_forward or 0)
                     >= full * _GATHERED_BYTES.get(dtype[k], 4) / 4)
    if not holders:
        raise CheckFailed("no FSDP run recorded its parameter bytes after forward; re-run section 2")
    got = ev.answer("04.holds_all_params")
    ok = isinstance(got, str) and got.strip().lower() in holders
    return ok, f"answer {got!r} {'is' if ok else 'is not'} a run that held all parameters after forward"


CHECKS = (
    cell_ran("every cell ran without error", 1),
    figure_present("DDP vs FSDP comparison plotted", 1),
    relation("fsdp holds fewer parameter bytes per rank than ddp", 1, bytes_below("param", "fsdp", "ddp"),
             reads=(("run", "fsdp"), ("run", "ddp"))),
    relation("fsdp-grad-op shards gradients below ddp", 1, bytes_below("grad", "fsdp-grad-op", "ddp"),
             reads=(("run", "fsdp-grad-op"),)),
    relation("fsdp trains with ddp's losses", 1, losses_agree("fsdp", "ddp", 0.02), visible=False,
             reads=(("run", "fsdp"), ("run", "ddp"))),
    answer_close("4.1 fsdp / ddp parameter bytes on rank 0", 2, "04.fsdp_param_ratio", param_ratio, rtol=0.01),
    relation("4.2 strategy holding all parameters between forward and backward", 2, _holds_all,
             reads=(("answer", "04.holds_all_params"), ("run", "fsdp-grad-op"))),
    answer_close("4.3 Llama-2-7B FULL_SHARD model states per GPU on 8 GPUs", 2, "04.llama7b_full_shard_8gpu_gb",
                 llama7b_full_shard_8, rtol=0.02),
    answer_close("4.4 FULL_SHARD bytes sent vs DDP", 2, "04.full_shard_comm_vs_ddp", comm_vs_ddp, rtol=0.01),
    answer_close("4.5a host bytes of the offload run", 1, "04.offload_host_bytes", offload_host_bytes, rtol=0.0),
    answer_equals("4.5b offload physically left the device", 1, "04.offload_physical", offload_physical),
    answer_equals("4.6 distributed_type accelerate really used", 1, "04.accelerate_distributed_type",
                  distributed_type),
)
