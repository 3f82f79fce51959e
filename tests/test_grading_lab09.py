"""The checks of notebook 09_beyond_3d grade right answers full and wrong ones zero (answers only:
the run-based checks are exercised by the executed notebook in tests/test_notebooks.py)."""
from __future__ import annotations

import json

import nbformat
from nbformat.v4 import new_code_cell, new_notebook, new_output

from labkit.profiling import commbench
from labkit.course.grading import registry
from labkit.course.grading.evaluate import grade_notebook
from labkit.course.grading.fingerprint import seal
from labkit.course.grading.nb_checks import lab09_beyond_3d as L
from labkit.results import MIME

NOTEBOOK = "09_beyond_3d"


def _notebook(answers: dict):
    cells = []
    for count, (key, value) in enumerate(answers.items(), 1):
        src = f"answer({key!r}, {value!r})"
        out = new_output("display_data", data={MIME: seal({"kind": "answer", "key": key, "value": value},
                                                           f"answer {key} = {value!r}", cell=(src, count)),
                                               "text/plain": f"answer {key} = {value!r}"})
        cells.append(new_code_cell(src, execution_count=count, outputs=[out]))
    nb = new_notebook(cells=cells, metadata={"labkit": {"notebook": NOTEBOOK}})
    return nbformat.from_dict(json.loads(json.dumps(nb)))


def _merged(merge) -> list:
    """The notebook's 9.6 example: two 4-key blocks of seeded q, k, v merged by `merge`."""
    import torch

    from labkit.parallel.context import block_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    first = block_attention(q, k[:, :, :4], v[:, :, :4], scale=0.5, causal=False)
    second = block_attention(q, k[:, :, 4:], v[:, :, 4:], scale=0.5, causal=False)
    return [t.flatten().tolist() for t in merge(*first, *second)]


def _right() -> dict:
    from labkit.parallel.context import merge_attention

    best = L._ranked()[0]
    return {"09.bus_factors": {op: [commbench.bus_factor(op, n) for n in range(2, 9)] for op in commbench.OPS},
            "09.bubble_interleaved_p4_m8": L.bubble_interleaved(None), "09.hang_rank": 0,
            "09.hang_function": "log_loss()", "09.days_175b_1024_mfu045": L.days_175b(None),
            "09.cheapest_175b_layout": best.layout, "09.cheapest_175b_cost": best.budget.cost,
            "09.ring_merge": _merged(merge_attention), "09.imbalance_contiguous_cp4": L.imbalance_contiguous(None),
            "09.imbalance_zigzag_cp4": 1.0, "09.expert_capacity_4096_e8_k2_cf125": 1280}


def _answer_points(grade) -> dict[str, float]:
    return {r.name: r.earned for r in grade.results if r.name[:2] == "9."}


def test_right_answers_earn_every_answer_point_and_wrong_ones_none():
    checks = registry.checks_for(NOTEBOOK)
    answer_checks = [c for c in checks if c.name[:2] == "9."]
    right = _answer_points(grade_notebook(_notebook(_right()), NOTEBOOK, checks))
    assert right == {c.name: c.points for c in answer_checks}
    wrong = dict(_right())
    wrong["09.bus_factors"] = {op: [2 * (n - 1) / n for n in range(2, 9)] for op in commbench.OPS}  # all-reduce everywhere
    wrong.update({"09.bubble_interleaved_p4_m8": 3 / 11, "09.hang_rank": 1, "09.hang_function": "barrier",
                  "09.days_175b_1024_mfu045": L.days_175b(None) * 0.45, "09.cheapest_175b_cost": 1.0,
                  "09.cheapest_175b_layout": {"gpus": 64, "dp": 8, "tp": 8, "pp": 1, "zero": 0},
                  "09.ring_merge": _merged(lambda oa, la, ob, lb: ((oa + ob) / 2, (la + lb) / 2)),
                  "09.imbalance_contiguous_cp4": 4 / 2.5, "09.imbalance_zigzag_cp4": 1.75,
                  "09.expert_capacity_4096_e8_k2_cf125": 1024})  # 4/2.5: rank 3's blocks over the mean, no diagonal halving
    assert sum(_answer_points(grade_notebook(_notebook(wrong), NOTEBOOK, checks)).values()) == 0


def test_the_cheapest_layout_is_a_fitting_one_and_ties_share_the_cost():
    rows = L._ranked()
    assert rows[0].budget.cost == min(r.budget.cost for r in rows)
    assert all(r.memory_gb <= 80 for r in rows)
