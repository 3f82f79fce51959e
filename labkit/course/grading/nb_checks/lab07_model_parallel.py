"""Checks of notebooks/07_model_parallel.ipynb: pipeline schedules, tensor parallelism and the 175B plan.

References come from labkit (`labkit.parallel.pipeline`, `labkit.parallel.tensor`, `labkit.parallel.planner`);
the answer keys are listed in docs/model_parallel.md ("Grading keys"). The bubble (7.1) and the GPU count
of TP=8 x PP=8 x DP=8 (7.4) are no longer questions: the first is the code exercise `bubble_fraction`
(notebooks/tests/07_model_parallel.py), the second was stated in the text.
"""
from __future__ import annotations

from labkit.facts import PipelineFacts
from labkit.course.grading.checks import (answer_close, answer_equals, bytes_below, cell_ran, figure_present,
                                   losses_agree, relation)
from labkit.course.grading.evidence import CheckFailed, Evidence

NOTEBOOK = "07_model_parallel"


def in_flight_p4_m8(ev: Evidence) -> list[int]:
    # Stage 0 of p = 4, m = 8: GPipe forwards all m before any backward; 1F1B warms up with p - s = 4
    # forwards, then alternates (Narayanan et al. 2021, Sec. 2.2).
    from labkit.parallel.comm import in_flight

    return [in_flight("gpipe", 4, 8, stage=0), in_flight("1f1b", 4, 8, stage=0)]


def tp_allreduces_per_layer(ev: Evidence) -> float:
    from labkit.parallel.tensor import expected_collectives

    return float(expected_collectives(3)["all_reduce"] - expected_collectives(2)["all_reduce"])


def _layout_fits(ev: Evidence):
    from labkit.parallel import planner

    got = ev.answer("07.layout_175b_64xa100")
    if not isinstance(got, dict) or set(got) != {"dp", "tp", "pp", "zero"}:
        raise CheckFailed(f"answer {got!r} must be a dict with exactly the keys dp, tp, pp, zero")
    fits = {(o.dp, o.tp, o.pp, o.zero) for o in planner.plan(planner.PlanRequest("gpt3-175b", 64, 8)).fits}
    ok = tuple(got[k] for k in ("dp", "tp", "pp", "zero")) in fits
    return ok, f"layout {got} {'fits' if ok else 'is not among the layouts the planner says fit'}"


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
    answer_equals("7.2 stage-0 micro-batches in flight, GPipe and 1F1B", 2, "07.in_flight_p4_m8",
                  in_flight_p4_m8),
    answer_close("7.3 all-reduces per added layer under TP", 2, "07.tp_allreduces_per_layer",
                 tp_allreduces_per_layer, rtol=0.0),
    relation("7.5 a 175B layout that fits on 64 A100 80GB", 3, _layout_fits,
             reads=(("answer", "07.layout_175b_64xa100"),)),
)
