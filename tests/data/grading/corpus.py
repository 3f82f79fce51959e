"""Builds the grading test corpus: a small course-like notebook, its checks, and broken submissions.

The good submission is a real papermill run (kernel `labkit`), so its seals are real; every other
submission is derived from it or from its source the way a student could break or forge one.
"""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from labkit.course.grading import checks as K
from labkit.zoo.presets import LLM_PRESETS

DEMO = "90_grading_demo"
TOTAL_POINTS = 11.0
SECRET = 0.4242  # expected value of the hidden check: must never appear in feedback

# step_time_s is measured, as every real run's is: two runs never share it (copy detection compares it).
_RUN = ('import time\n'
        'ddp = RunRecord(strategy="ddp", model="tiny-llama", profile=PROFILE, world_size=2, steps=3,\n'
        '                losses=[3.0, 2.5, 2.0], step_time_s=0.1 + time.perf_counter() % 1e-3, samples_per_s=80.0,\n'
        '                peak_bytes=[4_000_000] * 2,\n'
        '                param_bytes=[1_000_000] * 2, grad_bytes=[1_000_000] * 2, optimizer_bytes=[2_000_000] * 2,\n'
        '                trainable_params=250_000, device="cpu", dtype="float32", tokens_per_s=2560.0)\n'
        'R.show(ddp)')
_FIGURE = ('import io\nimport matplotlib\nmatplotlib.use("Agg")\nimport matplotlib.pyplot as plt\n'
           'from IPython.display import Image, display\n'
           'fig, ax = plt.subplots(figsize=(3, 2))\nax.plot(ddp.losses)\nbuf = io.BytesIO()\n'
           'fig.savefig(buf, format="png")\ndisplay(Image(buf.getvalue()))')
#: Cell index of each exercise in the demo notebook.
ANSWER_CELL, DDP_CELL, FSDP_CELL, SECRET_CELL = 3, 4, 5, 6


def llama_params(name: str) -> int:
    """Parameter count of a Llama preset (embeddings, attention, SwiGLU MLP, RMSNorms, untied head)."""
    c = LLM_PRESETS[name]
    h, kv = c["hidden_size"], c["hidden_size"] * c["num_key_value_heads"] // c["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * c["intermediate_size"] + 2 * h
    head = 0 if c["tie_word_embeddings"] else c["vocab_size"] * h
    return c["vocab_size"] * h + c["num_hidden_layers"] * per_layer + h + head


def demo_checks() -> list[K.Check]:
    return [
        K.cell_ran("every cell ran", 1),
        K.answer_close("7B parameter count", 2, "params_7b_billion",
                       reference=lambda ev: llama_params("llama2-7b") / 1e9, rtol=0.02),
        K.peak_below("FSDP per-rank peak below DDP", 2, "fsdp", "ddp"),
        K.fits_in("FSDP fits in 24 GiB", 1, "fsdp", 24),
        K.speedup_at_least("FSDP keeps half of DDP's throughput", 1, "fsdp", "ddp", 0.5),
        K.figure_present("loss curve plotted", 1, tag="figure"),
        K.answer_close("secret ratio", 3, "secret_ratio", SECRET, rtol=0.01, visible=False),
    ]


def demo_notebook(identity: str = DEMO, extra: str | None = None):
    """The unexecuted demo notebook; `extra` is a code cell inserted right after the imports."""
    params = new_code_cell('PROFILE = "smoke"', metadata={"tags": ["parameters"]})
    cells = [new_markdown_cell("# Grading demo"), params,
             new_code_cell("import dataclasses\nimport labkit.results as R\nfrom labkit.results import RunRecord"),
             new_code_cell('R.answer("params_7b_billion", 6.74)'),
             new_code_cell(_RUN),
             new_code_cell('fsdp = dataclasses.replace(ddp, strategy="fsdp", peak_bytes=[2_500_000] * 2,\n'
                           '                           samples_per_s=70.0)\nR.show(fsdp)'),
             new_code_cell(f'R.answer("secret_ratio", {SECRET})'),
             new_code_cell(_FIGURE, metadata={"tags": ["figure"]})]
    if extra is not None:
        cells.insert(3, new_code_cell(extra))
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "labkit", "display_name": "labkit (Python 3)", "language": "python"},
        "labkit": {"notebook": identity}})
    return nb


def execute(src: Path, dst: Path) -> Path:
    """Run `src` with papermill on kernel `labkit`, as a student's Jupyter would (real seals)."""
    papermill = Path(sys.executable).with_name("papermill")
    subprocess.run([str(papermill), str(src), str(dst), "-k", "labkit", "--no-progress-bar"], check=True,
                   capture_output=True, timeout=240)
    return dst


def _answer_output(nb, cell: int) -> dict:
    return nb.cells[cell].outputs[0]


def hand_edited(executed):
    nb = copy.deepcopy(executed)
    _answer_output(nb, ANSWER_CELL)["data"]["application/vnd.labkit+json"]["value"] = 7.5
    return nb


def code_edited(executed):
    nb = copy.deepcopy(executed)
    nb.cells[ANSWER_CELL].source = 'R.answer("params_7b_billion", 6.74)  # changed after the run'
    return nb


def moved_output(executed):
    nb = copy.deepcopy(executed)
    nb.cells[ANSWER_CELL].outputs, nb.cells[SECRET_CELL].outputs = (
        nb.cells[SECRET_CELL].outputs, nb.cells[ANSWER_CELL].outputs)
    return nb


def unsealed(executed):
    nb = copy.deepcopy(executed)
    nb.cells[ANSWER_CELL].outputs[0]["data"]["application/vnd.labkit+json"].pop("fingerprint")
    return nb


def impossible(executed):
    """A run resealed with labkit's own seal (the seal's limit) but claiming throughput no CPU has."""
    from labkit.course.grading.fingerprint import seal

    nb = copy.deepcopy(executed)
    cell = nb.cells[DDP_CELL]
    out = cell.outputs[0]
    payload = dict(out["data"]["application/vnd.labkit+json"])
    payload["record"] = {**payload["record"], "samples_per_s": 1e12, "tokens_per_s": 3.2e13}
    out["data"]["application/vnd.labkit+json"] = seal(payload, out["data"]["text/plain"],
                                                      cell=(cell.source, cell.execution_count))
    return nb


def resealed(executed, step_time_s: float | None = None):
    """Someone's executed notebook with every result sealed again (a fresh nonce and time), as a student who
    reads labkit's source can: no seal in common with the original, every value identical. With
    `step_time_s` the DDP run's timing changes first: an independent honest run of the same notebook."""
    from labkit.course.grading.fingerprint import seal
    from labkit.results import MIME

    nb = copy.deepcopy(executed)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if MIME not in data:
                continue
            payload = dict(data[MIME])
            if step_time_s is not None and payload.get("kind") == "run":
                payload["record"] = {**payload["record"], "step_time_s": step_time_s}
            data[MIME] = seal(payload, data.get("text/plain"), cell=(cell.source, cell.execution_count))
    return nb


def deleted_cells(executed):
    nb = copy.deepcopy(executed)
    del nb.cells[FSDP_CELL]
    return nb


def wrong_notebook(executed):
    nb = copy.deepcopy(executed)
    nb.metadata["labkit"]["notebook"] = "91_other_lab"
    return nb


def huge(executed, mib: int = 100):
    nb = copy.deepcopy(executed)
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="x" * (mib * 2**20))]
    return nb


def write(root: Path, student: str, nb_or_text, name: str = DEMO) -> Path:
    path = root / student / f"{name}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(nb_or_text, str):
        path.write_text(nb_or_text)
    else:
        nbformat.write(nb_or_text, str(path))
    return path


MALFORMED = '{"cells": [{"cell_type": "code", "source": "x = 1",'
#: An infinite loop that also ignores the interrupt papermill sends on timeout, and SIGTERM.
LOOP = ("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True:\n    pass")
DIES = "import os\nos._exit(1)"
BOMB = "blocks = []\nwhile True:\n    blocks.append(bytearray(64 * 2**20))"
BIG_PRINT = 'print("x" * 100_000_000)'
NETWORK = 'import socket\nsocket.create_connection(("1.1.1.1", 53), timeout=5)'
