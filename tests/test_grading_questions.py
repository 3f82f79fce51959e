"""Questions graded on the student's own numbers: 03's efficiency (bounded), 07's bubble limit, TP counts and
the 175B design (recomputed with the planner the grader runs). No kernel: sealed payloads built here."""
from __future__ import annotations

import json

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

from labkit.course.grading import registry
from labkit.course.grading.evidence import Evidence
from labkit.course.grading.fingerprint import seal
from labkit.results import MIME

RUN = dict(model="tiny-resnet", steps=8, losses=[1.0], trainable_params=1, dtype="float32", global_batch=16)


def _evidence(notebook: str, profile: str, payloads: list[dict]) -> Evidence:
    cells = [new_code_cell(f'PROFILE = "{profile}"', execution_count=1, metadata={"tags": ["parameters"]})]
    for count, payload in enumerate(payloads, 2):
        src = f"record({payload['key']!r})"
        text = f"{payload['kind']} {payload['key']}"
        cells.append(new_code_cell(src, execution_count=count, outputs=[new_output(
            "display_data", data={MIME: seal(payload, text, cell=(src, count)), "text/plain": text})]))
    nb = new_notebook(cells=cells, metadata={"labkit": {"notebook": notebook}})
    return Evidence.from_notebook(nbformat.from_dict(json.loads(json.dumps(nb))))


def _run(key: str, ranks: int, step_s: float, cpu_s: list[float], device: str = "cpu", **extra) -> dict:
    record = {**RUN, "strategy": "ddp", "profile": "smoke", "world_size": ranks, "step_time_s": step_s,
              "samples_per_s": 16 / step_s, "device": device, "train": {"cpu_step_time_s": cpu_s}, **extra,
              **{f: [1] * ranks for f in ("param_bytes", "grad_bytes", "optimizer_bytes", "peak_bytes")}}
    return {"kind": "run", "key": key, "record": record}


def _answer(key: str, value) -> dict:
    return {"kind": "answer", "key": key, "value": value}


def _check(notebook: str, prefix: str):
    (check,) = [c for c in registry.checks_for(notebook) if c.name.startswith(prefix)]
    return check


# ---------------------------------------------------------------- 03, question 3.2
BUSY_CPU = [_run("ddp1", 1, 2.0, [0.4]), _run("ddp2", 2, 0.4, [0.25, 0.25])]  # wall efficiency 2.5, work 0.8


@pytest.mark.parametrize("answer, passed, says", [
    (0.8, True, "matches the efficiency of your recorded runs"),
    (0.6, False, "compute cpu_ms of 1 rank / cpu_ms of N ranks"),
    (2.5, False, "is not an efficiency of DDP"),  # the wall clock of a busy CPU (2.142 in issue 30)
    (2.142, False, "is not an efficiency of DDP"),
])
def test_efficiency_on_cpu_is_the_work_efficiency_and_bounded(answer, passed, says):
    ev = _evidence("03_ddp", "smoke", [*BUSY_CPU, _answer("03.measured_efficiency", answer)])
    result = _check("03_ddp", "3.2").run(ev)
    assert result.passed is passed and says in result.message
    assert "0.8" not in result.message or passed  # a failing visible check never names the value


def test_efficiency_on_a_gpu_is_the_wall_clock_one():
    gpu = [_run("ddp1", 1, 1.0, [1.0], device="cuda"), _run("ddp4", 4, 0.3, [0.3] * 4, device="cuda")]
    check = _check("03_ddp", "3.2")
    assert check.run(_evidence("03_ddp", "a100x4", [*gpu, _answer("03.measured_efficiency", 1 / 1.2)])).passed


def test_a_measurement_out_of_bounds_asks_for_a_new_run():
    odd = [_run("ddp1", 1, 1.0, [1.0]), _run("ddp2", 2, 0.2, [0.2, 0.2])]  # work efficiency 2.5: broken timing
    result = _check("03_ddp", "3.2").run(_evidence("03_ddp", "smoke", [*odd, _answer("03.measured_efficiency", 2.5)]))
    assert not result.passed and "re-run section 2" in result.message


# ---------------------------------------------------------------- 07, questions 7.2 - 7.4
def test_bubble_limit_comes_from_the_students_stage_times():
    trace = [dict(stage=s, kind=k, mb=i, t0=0.0, t1=t) for s, t in ((0, 1.0), (1, 4.0)) for k in "FB" for i in range(2)]
    run = {"kind": "run", "key": "1f1b", "record": {**RUN, "strategy": "pipeline-1f1b", "profile": "smoke",
           "world_size": 2, "step_time_s": 1.0, "samples_per_s": 8.0, "device": "cpu",
           "pipeline": {"pp": 2, "schedule": "1f1b", "microbatches": 2, "schedule_trace": trace},
           **{f: [1] * 2 for f in ("param_bytes", "grad_bytes", "optimizer_bytes", "peak_bytes")}}}
    check = _check("07_model_parallel", "7.2")
    assert check.run(_evidence("07_model_parallel", "smoke", [run, _answer("07.bubble_limit", 0.75)])).passed
    assert not check.run(_evidence("07_model_parallel", "smoke", [run, _answer("07.bubble_limit", 0.0)])).passed


def test_tp_counts_this_plan_and_megatrons_fused_layer():
    check = _check("07_model_parallel", "7.3")
    assert check.run(_evidence("07_model_parallel", "smoke", [_answer("07.tp_allreduces_per_layer", [7, 4])])).passed
    wrong = check.run(_evidence("07_model_parallel", "smoke", [_answer("07.tp_allreduces_per_layer", [7, 7])]))
    assert not wrong.passed and "[7, 4]" not in wrong.message


def _design(layout: dict, numbers: dict) -> Evidence:
    return _evidence("07_model_parallel", "smoke", [_answer("07.layout_175b_64xa100", layout),
                                                    _answer("07.layout_175b_numbers", numbers)])


def test_the_175b_design_needs_a_pipeline_and_the_planners_numbers():
    from labkit.parallel import planner

    result = planner.plan(planner.PlanRequest("gpt3-175b", 64, 8))
    first = result.fits[0]
    mine = next(o for o in result.fits if o.pp > 1 and o.dims != first.dims)  # whatever the planner ranks first
    keys = ("dp", "tp", "pp", "zero", "micro_batch")
    layout = {k: getattr(mine, k) for k in keys}
    numbers = {"step_s": mine.step_s, "memory_gb": mine.memory_bytes / 1e9, "best_step_s": first.step_s}
    pipelined, justified = _check("07_model_parallel", "7.4a"), _check("07_model_parallel", "7.4b")
    assert pipelined.run(_design(layout, numbers)).passed and justified.run(_design(layout, numbers)).passed
    copied = pipelined.run(_design({k: getattr(first, k) for k in keys}, numbers))
    assert not copied.passed and ("pp=" in copied.message or "first row" in copied.message)
    flat = next(o for o in result.fits if o.pp == 1)
    assert not pipelined.run(_design({k: getattr(flat, k) for k in keys}, numbers)).passed
    guessed = justified.run(_design(layout, {**numbers, "step_s": 2 * numbers["step_s"]}))
    assert not guessed.passed and "step_s" in guessed.message
