"""Copied exercise code (issue #40 item 7): a renamed, reordered copy is flagged, two honest solutions are not.

Lab-01 notebooks whose exercise cells hold three students' code: ann's (the course's solution), a copy of it
with every name changed, comments added, a helper moved and the cells in the other order, and bob's own
solution (if/elif instead of tables, a loop instead of generator sums). Graded on recorded results with an
empty autograder folder, so no code test starts a process: the comparison is what is tested.
"""
from __future__ import annotations

import csv
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell

from labkit.course.grading import similarity
from labkit.course.grading.batch import GradeOptions, run_batch
from test_grading_shards import _lab01

MSB = "# EXERCISE model_state_bytes: bytes of weights + grads + optimizer states on one GPU\nimport math\n\n\n"
MEASURE = "# EXERCISE measure_state_bytes: run one training step, then count the bytes it keeps\nimport torch\n\n\n"
SIGNATURE = 'def model_state_bytes(params, precision="mixed-bf16", optimizer="adamw", zero_stage=0, dp=1):\n'

ANN = (MSB + SIGNATURE + '''\
    weight = {"fp32": 4, "bf16": 2, "fp16": 2, "mixed-bf16": 2, "mixed-fp16": 2}[precision]
    master = 4 if precision.startswith("mixed") else 0
    states = {"adamw": 2, "sgd-momentum": 1, "sgd": 0}[optimizer]
    state = 4 if master or precision == "fp32" else weight
    parts = {"weights": params * weight, "grads": params * weight,
             "optimizer": params * (master + states * state)}
    for stage, part in ((1, "optimizer"), (2, "grads"), (3, "weights")):
        if zero_stage >= stage:
            parts[part] = math.ceil(parts[part] / dp)
    return sum(parts.values())
''', MEASURE + '''\
def measure_state_bytes(model, optimizer, inputs):
    optimizer.zero_grad()
    loss = model(inputs).float().square().mean()
    loss.backward()
    optimizer.step()

    def size(t):
        return t.numel() * t.element_size()

    weights = sum(size(p) for p in model.parameters())
    grads = sum(size(p.grad) for p in model.parameters() if p.grad is not None)
    states = sum(size(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    return {"weights": weights, "grads": grads, "optimizer": states}
''')

COPY = (MSB + SIGNATURE + '''\
    # bytes per weight
    per_w = {"fp32": 4, "bf16": 2, "fp16": 2, "mixed-bf16": 2, "mixed-fp16": 2}[precision]
    mst = 4 if precision.startswith("mixed") else 0  # master copy
    n_states = {"adamw": 2, "sgd-momentum": 1, "sgd": 0}[optimizer]
    per_state = 4 if mst or precision == "fp32" else per_w

    buckets = {"weights": params * per_w, "grads": params * per_w,
               "optimizer": params * (mst + n_states * per_state)}
    for lvl, key in ((1, "optimizer"), (2, "grads"), (3, "weights")):
        if zero_stage >= lvl:
            buckets[key] = math.ceil(buckets[key] / dp)
    return sum(buckets.values())
''', MEASURE + '''\
def measure_state_bytes(model, optimizer, inputs):
    optimizer.zero_grad()
    l = model(inputs).float().square().mean()
    l.backward()
    optimizer.step()
    w_total = sum(nbytes(q) for q in model.parameters())
    g_total = sum(nbytes(q.grad) for q in model.parameters() if q.grad is not None)
    o_total = sum(nbytes(val) for st in optimizer.state.values() for val in st.values() if torch.is_tensor(val))
    return {"weights": w_total, "grads": g_total, "optimizer": o_total}


def nbytes(x):
    return x.numel() * x.element_size()
''')

BOB = (MSB + SIGNATURE + '''\
    if precision == "fp32":
        w_bytes, g_bytes, s_bytes, master = 4, 4, 4, 0
    elif precision in ("bf16", "fp16"):
        w_bytes, g_bytes, s_bytes, master = 2, 2, 2, 0
    else:
        w_bytes, g_bytes, s_bytes, master = 2, 2, 4, 4
    if optimizer == "adamw":
        n = 2
    elif optimizer == "sgd-momentum":
        n = 1
    else:
        n = 0
    weights = params * w_bytes
    grads = params * g_bytes
    opt = params * (n * s_bytes + master)
    if zero_stage >= 1:
        opt = math.ceil(opt / dp)
    if zero_stage >= 2:
        grads = math.ceil(grads / dp)
    if zero_stage >= 3:
        weights = math.ceil(weights / dp)
    return weights + grads + opt
''', MEASURE + '''\
def measure_state_bytes(model, optimizer, inputs):
    optimizer.zero_grad()
    out = model(inputs)
    loss = (out.float() ** 2).mean()
    loss.backward()
    optimizer.step()
    total = {"weights": 0, "grads": 0, "optimizer": 0}
    for p in model.parameters():
        total["weights"] += p.numel() * p.element_size()
        if p.grad is not None:
            total["grads"] += p.grad.numel() * p.grad.element_size()
    for st in optimizer.state.values():
        for value in st.values():
            if isinstance(value, torch.Tensor):
                total["optimizer"] += value.numel() * value.element_size()
    return total
''')


def _class(root: Path) -> Path:
    subs = root / "subs"
    for student, cells in {"ann": ANN, "bob": BOB, "cy": COPY[::-1]}.items():
        nb = _lab01(0.0)
        nb.cells += [new_code_cell(source) for source in cells]
        (subs / student).mkdir(parents=True)
        nbformat.write(nb, subs / student / "01_memory.ipynb")
    return subs


def test_a_renamed_reordered_copy_is_flagged_and_two_honest_solutions_are_not(tmp_path):
    (tmp_path / "no-tests").mkdir()
    out = tmp_path / "out"
    result = run_batch(_class(tmp_path), out, GradeOptions(autograder=str(tmp_path / "no-tests")))
    assert [(p.student, p.other, p.page) for p in result.code_pairs] == [("ann", "cy", "review/pair-001.html")]
    assert result.code_pairs[0].similarity >= 0.8  # 0.91 with copydetect 0.5.0; honest pairs 0.15
    with (out / "review.csv").open(newline="") as fh:
        review = list(csv.DictReader(fh))
    assert [(r["student"], r["other"], r["runs_in_common"], r["page"]) for r in review] == [
        ("ann", "cy", "0", "review/pair-001.html")]
    assert float(review[0]["code_similarity"]) == result.code_pairs[0].similarity
    page = (out / "review" / "pair-001.html").read_text()
    assert "<mark>" in page and "buckets[key]" in page and "parts[part]" in page
    rows = {r.student: r for r in result.rows}
    assert "exercise code" in rows["cy"].review and "ann's (review/pair-001.html)" in rows["cy"].review
    assert rows["bob"].review == "" and rows["ann"].score == rows["cy"].score  # nobody's score changes
    assert "cy" not in (out / "feedback" / "ann.html").read_text()  # feedback never names the other student


def _rows(**codes):
    return [type("Row", (), {"student": s, "notebook": "01_memory", "code": c})() for s, c in codes.items()]


def test_honest_solutions_stay_far_below_the_threshold_and_the_release_is_boilerplate():
    import nbformat as nbf

    from labkit.course.exercises.source import exercise_cells, stub

    assert similarity.find_pairs(_rows(ann="\n\n".join(ANN), bob="\n\n".join(BOB)), 0.3) == []
    cells = exercise_cells(nbf.read(str(Path(__file__).parent.parent / "notebooks" / "01_memory.ipynb"), 4))
    released = "\n\n".join(stub(cells[k], k) for k in sorted(cells))
    assert similarity.boilerplate("01_memory")  # the stubbed release cells of the source tree
    assert similarity.find_pairs(_rows(x=released, y=released), 0.01) == []  # nobody attempted: nothing shared
    short = MSB + SIGNATURE + "    return params * 16\n"
    assert similarity.find_pairs(_rows(x=short, y=short), 0.01) == []  # one shared line is what honest work gives
