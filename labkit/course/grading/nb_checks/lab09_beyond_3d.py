"""Checks of notebooks/09_beyond_3d.ipynb: bus bandwidth, virtual-stage pipelines, the hang, the 175B budget.

References come from labkit (`labkit.profiling.commbench.bus_factor`, `labkit.parallel.pipeline_virtual`,
`labkit.parallel.budget` on `labkit.parallel.planner.budget`); the answer keys are listed in docs/beyond_3d.md.
"""
from __future__ import annotations

import functools

from labkit.facts import ExpertFacts, PipelineFacts
from labkit.course.grading.checks import answer_close, answer_equals, cell_ran, figure_present, losses_agree, relation
from labkit.course.grading.evidence import CheckFailed, Evidence

NOTEBOOK = "09_beyond_3d"
GPU_COUNTS = (64, 128, 256, 512, 1024)
#: Relative loss agreement by the runs' dtype: fp32 pipelines / CP / EP match the single process to ~1e-6;
#: 16-bit runs round differently per schedule and sharding (notebook 07's checks allow 0.02 the same way).
LOSS_RTOL = {"float32": 1e-3, "bfloat16": 0.02, "float16": 0.02}


def _bus_factors(ev: Evidence):
    from labkit.profiling.commbench import OPS, bus_factor

    got = ev.answer("09.bus_factors")
    if not isinstance(got, dict) or set(got) != set(OPS):
        raise CheckFailed(f"answer must be a dict with one list per collective ({', '.join(OPS)})")
    wrong = [op for op in OPS if not isinstance(got[op], list) or len(got[op]) != 7 or any(
        not isinstance(x, (int, float)) or abs(x - bus_factor(op, n)) > 1e-6 for x, n in zip(got[op], range(2, 9)))]
    return not wrong, "every factor matches nccl-tests" if not wrong else f"wrong for: {', '.join(wrong)}"


def bubble_interleaved(ev: Evidence) -> float:
    from labkit.parallel.pipeline_virtual import interleaved_bubble

    return interleaved_bubble(4, 8)


def imbalance_contiguous(ev: Evidence) -> float:
    from labkit.parallel.context_variants import causal_pairs, imbalance

    return imbalance(causal_pairs(4096, 4, "contiguous"))


def days_175b(ev: Evidence) -> float:
    from labkit.parallel.budget import days_at_mfu
    from labkit.memory.params import model_spec
    from labkit.parallel.perf_model import GPUS

    return days_at_mfu(model_spec("gpt3-175b").params, 300e9, 1024, GPUS["a100-80gb"].peak_tflops, 0.45)


@functools.lru_cache(maxsize=1)
def _ranked():
    from labkit.parallel.budget import rank_by_cost

    return rank_by_cost("gpt3-175b", 300e9, GPU_COUNTS, price_per_gpu_hour=2.0)


def cheapest_cost(ev: Evidence) -> float:
    return _ranked()[0].budget.cost


def _cheapest_layout(ev: Evidence):
    got = ev.answer("09.cheapest_175b_layout")
    keys = {"gpus", "dp", "tp", "pp", "zero"}
    if not isinstance(got, dict) or set(got) != keys:
        raise CheckFailed(f"answer {got!r} must be a dict with exactly the keys {', '.join(sorted(keys))}")
    rows = [r for r in _ranked() if r.layout == got]
    if not rows:
        return False, f"layout {got} is not among the layouts that fit in 80 GB"
    ok = rows[0].budget.cost <= 1.01 * cheapest_cost(ev)  # ties: several layouts share the cheapest cost
    return ok, f"layout {got} {'is' if ok else 'is not'} among the cheapest"


def _zero_bubble_splits_backward(ev: Evidence):
    events = (ev.run("zero_bubble").pipeline or PipelineFacts()).schedule_trace
    n = sum(e.get("kind") == "W" for e in events)
    return n > 0, f"the zero-bubble schedule ran {n} weight-gradient (W) chunks"


def _ring_merge(ev: Evidence):
    """9.6: the student's merge of two key blocks, recorded on the notebook's seeded inputs."""
    import torch

    got = ev.answer("09.ring_merge")
    if not isinstance(got, list) or len(got) != 2:
        raise CheckFailed("answer must be [merged output, merged lse] as the notebook records them")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    full = torch.softmax(q @ k.transpose(-2, -1) * 0.5, dim=-1) @ v
    lse = torch.logsumexp(q @ k.transpose(-2, -1) * 0.5, dim=-1)
    try:
        out, got_lse = torch.tensor(got[0]).view_as(full), torch.tensor(got[1]).view_as(lse)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise CheckFailed(f"answer has the wrong shape: {exc}") from None
    ok = torch.allclose(out, full, atol=1e-5) and torch.allclose(got_lse, lse, atol=1e-5)
    return ok, "equals attention over all keys" if ok else "differs from softmax attention over all keys"


def _ep_holds_a_share(ev: Evidence):
    rec = ev.run("expert_parallel")
    x = rec.expert or ExpertFacts()
    mine, total, n = x.expert_param_bytes, x.expert_param_bytes_all_ranks, x.ep
    ok = bool(mine) and bool(n) and n > 1 and mine * n == total
    return ok, f"each rank holds {mine} of {total} expert bytes (ep={n})"


def _names_log_loss(ev: Evidence):
    got = ev.answer("09.hang_function")
    ok = isinstance(got, str) and got.strip().strip("()").lower() == "log_loss"
    return ok, f"answer {got!r} {'names' if ok else 'does not name'} the function that called all_reduce"


CHECKS = (
    cell_ran("every cell ran without error", 1),
    figure_present("bandwidth, schedule and budget figures shown", 1),
    relation("interleaved 1F1B trains with the single process's losses", 1,
             losses_agree("interleaved", "single", LOSS_RTOL), reads=(("run", "interleaved"), ("run", "single"))),
    relation("zero-bubble trains with the single process's losses", 1,
             losses_agree("zero_bubble", "single", LOSS_RTOL), reads=(("run", "zero_bubble"), ("run", "single"))),
    relation("the zero-bubble schedule splits the backward", 1, _zero_bubble_splits_backward,
             reads=(("run", "zero_bubble"),)),
    relation("9.1 bus-bandwidth factors of every collective", 3, _bus_factors, reads=(("answer", "09.bus_factors"),)),
    answer_close("9.2 bubble of interleaved 1F1B at p=4, v=2, m=8", 2, "09.bubble_interleaved_p4_m8",
                 bubble_interleaved, rtol=0.01),
    relation("context-parallel trains with the single process's losses", 1,
             losses_agree("context_parallel", "single", LOSS_RTOL), reads=(("run", "context_parallel"), ("run", "single"))),
    relation("expert-parallel trains with the single process's losses on tiny-moe", 1,
             losses_agree("expert_parallel", "moe_single", LOSS_RTOL),
             reads=(("run", "expert_parallel"), ("run", "moe_single"))),
    relation("each expert-parallel rank holds 1/N of the expert weights", 1, _ep_holds_a_share,
             reads=(("run", "expert_parallel"),)),
    answer_equals("9.3a the rank waiting in all_reduce", 1, "09.hang_rank", 0),
    relation("9.3b the function that called it", 1, _names_log_loss, reads=(("answer", "09.hang_function"),)),
    answer_close("9.4 days for 175B on 300B tokens, 1024 A100s, MFU 0.45", 2, "09.days_175b_1024_mfu045",
                 days_175b, rtol=0.01),
    relation("9.5a the cheapest 175B layout within 80 GB", 3, _cheapest_layout,
             reads=(("answer", "09.cheapest_175b_layout"),)),
    relation("9.6 the ring-attention merge step", 2, _ring_merge, reads=(("answer", "09.ring_merge"),)),
    answer_close("9.5b its cost", 1, "09.cheapest_175b_cost", cheapest_cost, rtol=0.02, visible=False),
    answer_close("9.7a causal-mask imbalance of the contiguous split, cp = 4", 1, "09.imbalance_contiguous_cp4",
                 imbalance_contiguous, rtol=0.01),
    answer_close("9.7b the same with the zig-zag split", 1, "09.imbalance_zigzag_cp4", 1.0, rtol=0.01),
    answer_equals("9.8 slots per expert at capacity factor 1.25", 1, "09.expert_capacity_4096_e8_k2_cf125", 1280),
)
