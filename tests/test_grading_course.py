"""The declared checks of the course notebooks agree with the notebooks (identity, recorded keys)."""
from __future__ import annotations

import json
import pkgutil
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

from labkit.course.grading import nb_checks, registry
from labkit.course.grading.evaluate import grade_notebook
from labkit.course.grading.evidence import Evidence, identity
from labkit.course.grading.fingerprint import seal
from labkit.course.grading.nb_checks import lab00_setup
from labkit.results import MIME

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
#: Notebooks with a checks module in labkit/course/grading/nb_checks (not test registrations).
COURSE = sorted(m.name[3:] for m in pkgutil.iter_modules(nb_checks.__path__) if m.name.startswith("lab"))


@pytest.mark.parametrize("notebook", COURSE)
def test_declared_checks_match_the_course_notebook(notebook):
    checks = registry.checks_for(notebook)
    assert checks and sum(c.points for c in checks) > 0
    path = NOTEBOOKS / f"{notebook}.ipynb"
    assert path.exists(), f"checks are declared for {notebook} but {path} does not exist"
    nb = nbformat.read(str(path), 4)
    assert identity(nb) == notebook, f'{path.name} needs metadata {{"labkit": {{"notebook": "{notebook}"}}}}'
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    for check in checks:
        for kind, key in check.reads:
            assert f'"{key}"' in source or f"'{key}'" in source, f"{check.name}: {path.name} never records {key!r}"


def _answered(key, value):
    src = f"answer({key!r}, {value!r})"
    out = new_output("display_data", data={MIME: seal({"kind": "answer", "key": key, "value": value},
                                                       f"answer {key} = {value!r}", cell=(src, 1)),
                                           "text/plain": f"answer {key} = {value!r}"})
    nb = new_notebook(cells=[new_code_cell(src, execution_count=1, outputs=[out])],
                      metadata={"labkit": {"notebook": "00_setup"}})
    return nbformat.from_dict(json.loads(json.dumps(nb)))


def test_setup_checks_grade_the_lease_answer():
    minute = lab00_setup.copy_off_minute(None)
    assert 0 < minute < 175  # a 3-hour block ends at 2:55
    checks = registry.checks_for("00_setup")
    right = grade_notebook(_answered("00.copy_off_done_by_min", minute), "00_setup", checks)
    wrong = grade_notebook(_answered("00.copy_off_done_by_min", minute + 10), "00_setup", checks)
    assert right.status == wrong.status == "graded"
    assert right.score == right.max_score and wrong.score == right.score - 2



def _ddp_notebook(profile: str, ranks: dict[str, int], scaling_cap: float):
    """An 03_ddp-like notebook: one sealed run per key and world size; throughput stops growing at the cap."""
    rec = dict(strategy="ddp", model="resnet50", profile=profile, steps=5, losses=[1.0], step_time_s=1.0,
               trainable_params=1, device="cuda", dtype="bfloat16")
    cells = [new_code_cell(f'PROFILE = "{profile}"', execution_count=1, metadata={"tags": ["parameters"]})]
    for count, (key, n) in enumerate(ranks.items(), 2):
        src = f"show({key!r})"
        record = {**rec, "world_size": n, "samples_per_s": 100.0 * min(n, scaling_cap),
                  **{f: [0] * n for f in ("param_bytes", "grad_bytes", "optimizer_bytes", "peak_bytes")}}
        payload = seal({"kind": "run", "key": key, "record": record}, key, cell=(src, count))
        cells.append(new_code_cell(src, execution_count=count,
                                   outputs=[new_output("display_data", data={MIME: payload, "text/plain": key})]))
    nb = new_notebook(cells=cells, metadata={"labkit": {"notebook": "03_ddp"}})
    return Evidence.from_notebook(nbformat.from_dict(json.loads(json.dumps(nb))))


def test_ddp_relations_depend_on_profile_and_rank_counts():
    checks = {c.name: c for c in registry.checks_for("03_ddp")}
    floor, ranks = checks["largest DDP run reaches the speedup floor"], checks["DDP runs ran on the ranks they claim"]
    ladder = {"ddp1": 1, "ddp2": 2, "ddp4": 4, "ddp_accum": 4}
    assert floor.run(_ddp_notebook("a100x4", ladder, scaling_cap=3)).passed  # 3x on 4 GPUs >= 2x
    slow = floor.run(_ddp_notebook("a100x4", ladder, scaling_cap=1.5))
    assert not slow.passed and "4-rank speedup 1.50x (floor 2x" in slow.message
    assert floor.run(_ddp_notebook("smoke", ladder, scaling_cap=1.5)).passed  # CPU ranks share 2 cores
    assert ranks.run(_ddp_notebook("a100x4", ladder, scaling_cap=3)).passed
    relabelled = ranks.run(_ddp_notebook("a100x4", {**ladder, "ddp4": 2}, scaling_cap=3))
    assert not relabelled.passed and "run 'ddp4' reports world_size=2" in relabelled.message
