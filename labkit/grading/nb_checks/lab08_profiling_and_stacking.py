"""Checks of notebooks/08_profiling_and_stacking.ipynb: traces, the OOM playbook, and the FSDP2 + QLoRA stack.

The trace files stay on the student's node, so profile answers are checked for form (a category the
summary can name); the OOM answers against `labkit.oom.playbook` on the same scenario; the NF4
shard fractions against the student's own recorded `fsdp-qlora` run and FSDP's 1/world-size rule.
"""
from __future__ import annotations

import functools
import tempfile

from labkit.grading.checks import answer_close, answer_equals, bytes_below, cell_ran, figure_present, relation
from labkit.grading.evidence import Evidence

NOTEBOOK = "08_profiling_and_stacking"


def _category(key: str):
    def pred(ev: Evidence):
        from labkit.trace_analysis import CATEGORIES

        got = ev.answer(key)
        ok = isinstance(got, str) and got.strip().lower() in CATEGORIES
        return ok, f"answer {key!r} = {got!r} {'is' if ok else 'is not'} one of {', '.join(CATEGORIES)}"
    return pred


@functools.lru_cache(maxsize=1)
def _book_7b():
    from labkit import oom

    with tempfile.TemporaryDirectory() as folder:  # scenarios() writes the 70B config it also returns
        cfg, gpu_bytes, host_bytes, title = oom.scenarios(folder)["7b-on-4090"]
        return oom.playbook(cfg, gpu_bytes, host_bytes=host_bytes, title=title)


def lever_7b(ev: Evidence) -> str:
    return _book_7b().path[-1]


def _names_lever(ev: Evidence):
    # The playbook prints long lever labels ("LoRA adapters r=8 (freeze the base)"): its first word
    # names it ("lora"), and no two levers on the 7B path share one.
    lever, got = lever_7b(ev), ev.answer("08.oom_7b_lever")
    ok = isinstance(got, str) and lever.split()[0].lower() in got.lower()
    return ok, f"answer {got!r} {'names' if ok else 'does not name'} the playbook's last lever"


def gb_7b(ev: Evidence) -> float:
    return _book_7b().final.total / 1e9


def nf4_rank0(ev: Evidence) -> float:
    x = ev.run("fsdp_qlora").peft
    return x.packed_4bit_rank_bytes / x.packed_4bit_full_bytes


def _adapters_only(ev: Evidence):
    r = ev.run("fsdp_qlora")
    total = (r.peft.total_params if r.peft else None) or 0
    ok = 0 < r.trainable_params < 0.5 * total
    return ok, f"fsdp_qlora trains {r.trainable_params:,} of {total:,} parameters"


CHECKS = (
    cell_ran("every cell ran without error", 1),
    figure_present("step-time breakdown and memory timelines shown", 1),
    relation("fsdp keeps fewer parameter bytes per rank than ddp (traced runs)", 1,
             bytes_below("param", "fsdp_traced", "ddp_traced"), reads=(("run", "fsdp_traced"), ("run", "ddp_traced"))),
    relation("fsdp-qlora trains the adapters only", 1, _adapters_only, reads=(("run", "fsdp_qlora"),)),
    relation("8.1a FSDP bottleneck names a profile category", 1, _category("08.fsdp_bottleneck"),
             reads=(("answer", "08.fsdp_bottleneck"),)),
    relation("8.1b DDP bottleneck names a profile category", 1, _category("08.ddp_bottleneck"),
             reads=(("answer", "08.ddp_bottleneck"),)),
    answer_equals("8.2 all-gathers per FSDP unit per step", 2, "08.allgathers_per_unit_per_step", 2),
    relation("8.3a the lever that makes 7B fit a 4090", 2, _names_lever, reads=(("answer", "08.oom_7b_lever"),)),
    answer_close("8.3b estimated GB per GPU at that point", 2, "08.oom_7b_gb", gb_7b, rtol=0.05),
    answer_close("8.4a NF4 bytes on rank 0, as a fraction", 1, "08.nf4_fraction_rank0", nf4_rank0, rtol=0.02),
    answer_close("8.4b the same on 4 GPUs", 1, "08.nf4_fraction_4gpus", 0.25, rtol=0.02, visible=False),
)
