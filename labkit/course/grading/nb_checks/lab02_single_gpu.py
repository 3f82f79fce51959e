"""Checks of notebooks/02_single_gpu.ipynb: the baseline and lever runs, and the questions about them.

The code exercises (amp_accum_step, checkpointed_block) are graded by notebooks/tests/{,hidden/}02_single_gpu.py.

Answers about a run are checked against the student's own recorded run (grading never re-runs a GPU).
"""
from __future__ import annotations

from labkit.course.grading.checks import answer_close, cell_ran, figure_present, relation
from labkit.course.grading.evidence import CheckFailed, Evidence

NOTEBOOK = "02_single_gpu"
LEVERS = ("baseline", "amp", "accum", "checkpointing", "channels_last")


def amp_speedup(ev: Evidence) -> float:
    return ev.run("amp").samples_per_s / ev.run("baseline").samples_per_s


def steps_per_epoch(ev: Evidence) -> float:
    from labkit.train.data import FOOD11_TRAIN_IMAGES

    return float(FOOD11_TRAIN_IMAGES // 256)  # partial batches dropped


def _all_levers(ev: Evidence):
    runs = {key: ev.run(key) for key in LEVERS}
    return True, f"{len(runs)} lever runs recorded"


def _accum_peak_not_higher(ev: Evidence):
    # Same global batch in 2 micro-batches: activations halve, model states stay (2% slack for allocator noise).
    accum, base = max(ev.run("accum").peak_bytes), max(ev.run("baseline").peak_bytes)
    ok = accum <= 1.02 * base
    return ok, f"accum peak {accum / 2**20:.1f} MiB vs baseline {base / 2**20:.1f} MiB"


def _amp_faster_on_gpu(ev: Evidence):
    # Tensor cores make AMP ~2.6x faster on A100 (NVIDIA: 2470 vs 938 img/s); CPU smoke runs prove nothing.
    floor = 0.0 if ev.on_cpu else 1.3
    speedup = amp_speedup(ev)
    return speedup >= floor, f"AMP speedup {speedup:.2f}x (floor {floor:g}x on profile {ev.profile})"


def _shrink_plausible(ev: Evidence):
    value = ev.answer("02.checkpointing_activation_shrink")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckFailed(f"answer '02.checkpointing_activation_shrink' is {value!r}; record a number")
    # Baseline / checkpointed activations: checkpointing never grows them, and 16 ResNet blocks bound it.
    return 1.0 <= value <= 20.0, f"activation shrink {value:g}x"


CHECKS = (
    cell_ran("every cell ran without error", 1),
    relation("all five lever runs recorded", 2, _all_levers, reads=tuple(("run", k) for k in LEVERS)),
    figure_present("lever chart plotted", 1),
    relation("accumulation does not raise the peak", 1, _accum_peak_not_higher,
             reads=(("run", "accum"), ("run", "baseline"))),
    relation("AMP speeds up training on a GPU", 2, _amp_faster_on_gpu, visible=False,
             reads=(("run", "amp"), ("run", "baseline"))),
    answer_close("2.1 AMP speedup over the baseline", 2, "02.amp_speedup", amp_speedup, rtol=0.05),
    answer_close("2.2a --accum for 256 in micro-batches of 64", 1, "02.accum_for_256_at_64", 256 / 64, rtol=0.0),
    answer_close("2.2b optimizer steps per Food-11 epoch at 256", 2, "02.steps_per_epoch_food11_256",
                 steps_per_epoch, rtol=0.0),
    relation("2.3 activation shrink from checkpointing", 1, _shrink_plausible,
             reads=(("answer", "02.checkpointing_activation_shrink"),)),
)
