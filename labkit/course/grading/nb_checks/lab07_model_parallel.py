"""Checks of notebooks/07_model_parallel.ipynb: pipeline schedules, tensor parallelism and the 175B plan.

References come from labkit (`labkit.parallel.comm`, `labkit.parallel.tensor`, `labkit.parallel.planner`),
computed at grading time -- the 175B design is recomputed with the planner the grader runs, so it holds
whatever the planner ranks first; the answer keys are listed in docs/model_parallel.md ("Grading keys").
The closed-form bubble is the code exercise `bubble_fraction` (notebooks/tests/07_model_parallel.py).
"""
from __future__ import annotations

import functools

from labkit.facts import PipelineFacts
from labkit.course.grading.checks import (answer_close, answer_equals, answered, bytes_below, cell_ran,
                                          figure_present, losses_agree, relation)
from labkit.course.grading.evidence import CheckFailed, Evidence

NOTEBOOK = "07_model_parallel"


def in_flight_p4_m8(ev: Evidence) -> list[int]:
    # Stage 0 of p = 4, m = 8: GPipe forwards all m before any backward; 1F1B warms up with p - s = 4
    # forwards, then alternates (Narayanan et al. 2021, Sec. 2.2).
    from labkit.parallel.comm import in_flight

    return [in_flight("gpipe", 4, 8, stage=0), in_flight("1f1b", 4, 8, stage=0)]


def bubble_limit(ev: Evidence) -> float:
    # 7.2: the fastest stage's bubble as m grows, 1 - t_min / t_max, from the stage times the student's
    # own `1f1b` run measured (labkit.parallel.comm.uneven_bubble's limit).
    from labkit.parallel.comm import stage_times

    pipe = ev.run("1f1b").pipeline or PipelineFacts()
    if not pipe.schedule_trace:
        raise CheckFailed("the 1f1b run carries no measured schedule; re-run section 1")
    times = list(pipe.stage_ms) or stage_times(pipe.schedule_trace)  # what bubble_rows shows as stage_ms
    return 1 - min(times) / max(times)


def tp_allreduces_per_layer(ev: Evidence) -> list[int]:
    # 7.3: [this plan (HF Llama: separate q, k, v, gate, up), Megatron-LM's fused layer (Shoeybi et al.
    # 2019, Fig. 4: 2 forward + 2 backward)] all-reduces per added decoder layer.
    from labkit.parallel.tensor import expected_collectives

    return [expected_collectives(3, fused=f)["all_reduce"] - expected_collectives(2, fused=f)["all_reduce"]
            for f in (False, True)]


LAYOUT_KEYS = ("dp", "tp", "pp", "zero", "micro_batch")
NUMBER_KEYS = ("step_s", "memory_gb", "best_step_s")


@functools.lru_cache(maxsize=1)
def _plan_175b():
    from labkit.parallel import planner

    return planner.plan(planner.PlanRequest("gpt3-175b", 64, 8))


def _chosen(ev: Evidence):
    """The planner's row of the student's 175B layout (recomputed now, whatever the planner ranks first)."""
    got = answered(ev, "07.layout_175b_64xa100")
    if not isinstance(got, dict) or set(got) != set(LAYOUT_KEYS):
        raise CheckFailed(f"answer {got!r} must be a dict with exactly the keys {', '.join(LAYOUT_KEYS)}")
    fits = _plan_175b().fits
    row = next((o for o in fits if all(getattr(o, k) == got[k] for k in LAYOUT_KEYS)), None)
    if row is None:
        raise CheckFailed(f"layout {got} is not a row the planner says fits; pick one from its table")
    return row, fits[0]


def _layout_pipelined(ev: Evidence):
    row, best = _chosen(ev)
    if row.pp < 2:
        return False, f"your layout has pp={row.pp}; the exercise asks for pipeline parallelism (pp > 1)"
    if row.dims == best.dims:
        return False, "your layout is the planner's first row's dp, tp, pp, zero; pick another with pp > 1 and compare"
    return True, f"dp={row.dp} tp={row.tp} pp={row.pp} zero={row.zero} fits and differs from the planner's first row"


def _layout_numbers(ev: Evidence):
    got = answered(ev, "07.layout_175b_numbers")
    if not isinstance(got, dict) or set(got) != set(NUMBER_KEYS):
        raise CheckFailed(f"answer {got!r} must be a dict with exactly the keys {', '.join(NUMBER_KEYS)}")
    try:
        row, best = _chosen(ev)
    except CheckFailed as exc:  # its own message, not 7.4a's (issue #39): what 7.4b needs from 7.4a
        raise CheckFailed(f"your numbers are read from the planner's row of your 7.4a layout, which 7.4a does "
                          f"not accept yet ({str(exc)[:160]}): finish 7.4a first, then copy that row's numbers")
    want = {"step_s": row.step_s, "memory_gb": row.memory_bytes / 1e9, "best_step_s": best.step_s}
    wrong = [k for k in NUMBER_KEYS if isinstance(got[k], bool) or not isinstance(got[k], (int, float))
             or abs(got[k] - want[k]) > 0.02 * abs(want[k]) + 1e-3]
    if wrong:
        return False, (f"{', '.join(wrong)} differ from the planner's numbers for your layout and its first row; "
                       "read them from planner.evaluate(req, **layout) and planner.plan(req).fits[0]")
    return True, "the step times and the memory your justification uses are the planner's"


def _1f1b_holds_fewer(ev: Evidence):
    # The measured schedules: 1F1B caps stage 0's in-flight micro-batches at p, GPipe holds all m.
    g, f = ((ev.run(k).pipeline or PipelineFacts()).max_in_flight for k in ("gpipe", "1f1b"))
    if not g or not f:
        raise CheckFailed("the pipeline runs carry no measured schedule; re-run section 1")
    return f[0] < g[0], f"stage 0 held at most {f[0]} micro-batches under 1F1B, {g[0]} under GPipe"


CHECKS = (
    cell_ran("every cell ran without error", 1),
    figure_present("pipeline schedules drawn", 1),
    relation("1F1B holds fewer micro-batches on stage 0 than GPipe", 1, _1f1b_holds_fewer,
             reads=(("run", "gpipe"), ("run", "1f1b"))),
    relation("each pipeline stage holds fewer parameter bytes than the single model", 1,
             bytes_below("param", "gpipe", "single"), reads=(("run", "single"),)),
    relation("the pipeline trains with the single process's losses", 1, losses_agree("1f1b", "single", 0.02),
             visible=False, reads=(("run", "1f1b"), ("run", "single"))),
    relation("tensor-fsdp trains with the single process's losses", 1,
             losses_agree("tensor_fsdp", "single", 0.02), visible=False, reads=(("run", "tensor_fsdp"),)),
    answer_equals("7.1 stage-0 micro-batches in flight, GPipe and 1F1B", 2, "07.in_flight_p4_m8",
                  in_flight_p4_m8),
    answer_close("7.2 the fastest stage's bubble as m grows, from your stage times", 2, "07.bubble_limit",
                 bubble_limit, rtol=0.03, atol=0.01),
    answer_equals("7.3 all-reduces per added layer, this plan and Megatron's fused layer", 2,
                  "07.tp_allreduces_per_layer", tp_allreduces_per_layer),
    relation("7.4a a pipelined 175B layout that fits, beside the planner's first", 2, _layout_pipelined,
             reads=(("answer", "07.layout_175b_64xa100"),)),
    relation("7.4b the planner's numbers behind your justification", 2, _layout_numbers,
             reads=(("answer", "07.layout_175b_numbers"),)),
    answer_close("7.5a bytes with sequence parallelism over bytes without (t = 4)", 1, "07.sp_bytes_ratio", 1.0,
                 rtol=0.01),
    answer_equals("7.5b reduce-scatters per layer forward with sequence parallelism", 1,
                  "07.sp_reduce_scatters_per_layer", 2),
)
