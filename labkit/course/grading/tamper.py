"""Is what a notebook records what its cells produced, on the hardware it claims?

Cells are numbered from 1 in notebook order, markdown cells included (as in every labkit message).

`problems(nb)` lists, per labkit payload: a missing or broken seal (hand-edited values or printed text),
a producing cell whose code changed after it ran or that shows another execution count (payload moved or
pasted), a payload outside a code cell, and physically impossible numbers: throughput above what the
recorded device can compute (a lower bound on FLOPs per token/sample against the device's dense peak),
per-rank memory above the device's capacity, MFU above 100 %, negative or non-finite measurements.
"""
from __future__ import annotations

import math
import re
from typing import Any

from labkit.course.grading.evidence import Recorded, cell_number, collect
from labkit.course.grading.fingerprint import cell_sha256, seal_problem
from labkit.memory.report import GPU_CAPACITIES

#: (pattern in the device name, dense peak TFLOPS at 16-bit on tensor cores, memory GiB): upper bounds of
#: each family (the fastest/largest variant), from the vendors' datasheets. First match wins.
DEVICE_SPECS: tuple[tuple[str, float, float], ...] = (
    (r"B200", 2250.0, 192.0), (r"H200", 989.0, 141.0), (r"H100", 989.0, 96.0), (r"GH200", 989.0, 144.0),
    (r"A100", 312.0, 80.0), (r"A800", 312.0, 80.0), (r"L40", 362.0, 48.0), (r"\bL4\b", 121.0, 24.0),
    (r"A10G?\b", 125.0, 24.0), (r"V100", 125.0, GPU_CAPACITIES["V100 32GB"] / 2**30), (r"T4\b", 65.0, 16.0),
    (r"4090", 330.0, GPU_CAPACITIES["RTX 4090 24GB"] / 2**30),
    (r"3090", 142.0, 24.0), (r"MI300", 1307.0, 192.0), (r"MI250", 383.0, 128.0),
)
#: A generous bound for one CPU socket (AMX bf16 on many cores): a CPU 'rank' cannot beat this.
CPU_PEAK_TFLOPS = 100.0
#: Forward FLOPs per sample of known vision models at their native 224x224 (torchvision: ResNet-50 is
#: 4.09 GMACs, He et al. 2016). Training costs ~3x this; the bound uses the forward pass only.
VISION_FWD_FLOPS_224 = {"resnet50": 2 * 4.09e9}
_FIELDS_NONNEG = ("step_time_s", "samples_per_s", "tokens_per_s", "mfu")


def device_spec(name: str) -> tuple[float, float | None]:
    """(peak FLOP/s, memory bytes or None) upper bounds for a device name as recorded in a seal."""
    if not name or name.lower().startswith("cpu"):
        return CPU_PEAK_TFLOPS * 1e12, None
    for pattern, tflops, gib in DEVICE_SPECS:
        if re.search(pattern, name, re.IGNORECASE):
            sized = re.search(r"(\d+)\s*GB", name, re.IGNORECASE)
            mem = float(sized.group(1)) if sized and float(sized.group(1)) <= gib else gib
            return tflops * 1e12, mem * 2**30
    # Unknown accelerator: the fastest we know, no memory bound.
    return max(t for _, t, _ in DEVICE_SPECS) * 1e12, None


def _finite_nonneg(record: dict[str, Any]) -> list[str]:
    bad = []
    for name in _FIELDS_NONNEG:
        value = record.get(name, 0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            bad.append(f"{name}={value!r} is not a finite non-negative number")
    for name in ("peak_bytes", "param_bytes", "grad_bytes", "optimizer_bytes"):
        values = record.get(name) or []
        if any(not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 for v in values):
            bad.append(f"{name}={values!r} holds negative or non-numeric bytes")
    return bad


def physical_problems(record: dict[str, Any], device: str) -> list[str]:
    """Numbers in one RunRecord dict that `device` (the sealed device name) cannot have produced."""
    bad = _finite_nonneg(record)
    if bad:
        return bad
    peak_flops, mem = device_spec(device)
    world = max(int(record.get("world_size") or 1), 1)
    budget = world * peak_flops  # FLOP/s all ranks together can do at best
    if record.get("mfu", 0) > 1.0:
        bad.append(f"MFU {record['mfu']:.2f} is above 100% of the device peak")
    # Every trained token/sample costs at least a forward pass: >= 2 FLOPs per parameter. A rank holds at
    # least max(param_bytes)/4 parameters (no format stores a parameter in more than 4 bytes here).
    params_lb = max(record.get("param_bytes") or [0]) / 4
    tokens, samples = record.get("tokens_per_s", 0), record.get("samples_per_s", 0)
    if params_lb and 2 * params_lb * max(tokens, samples) > budget:
        bad.append(f"throughput {max(tokens, samples):.3g}/s needs >= {2 * params_lb * max(tokens, samples):.3g}"
                   f" FLOP/s, above the peak of {world} x {device} ({budget:.3g} FLOP/s)")
    fwd = VISION_FWD_FLOPS_224.get(str(record.get("model", "")))
    if fwd:
        side = (record.get("notes") or record.get("extra") or {}).get("image_size", 224)
        need = samples * fwd * (float(side) / 224) ** 2
        if need > budget:
            bad.append(f"{record['model']} at {samples:.3g} samples/s needs {need:.3g} FLOP/s, above the "
                       f"peak of {world} x {device} ({budget:.3g} FLOP/s)")
    peaks = record.get("peak_bytes") or []
    if mem is not None and peaks and max(peaks) > mem * 1.02:
        bad.append(f"peak {max(peaks) / 2**30:.1f} GiB/rank is more than {device} holds ({mem / 2**30:.0f} GiB)")
    return bad


def payload_problems(rec: Recorded, cell, number: int) -> list[str]:
    """Integrity problems of one payload found in `cell` (the nbformat cell that holds it, the student's
    cell `number`)."""
    where = f"cell {number}: {rec.kind or 'result'} {rec.key!r}"
    if cell.get("cell_type") != "code":
        return [f"{where} sits in a {cell.get('cell_type')} cell (outputs only come from code cells)"]
    broken = seal_problem(rec.payload, rec.text)
    if broken:
        return [f"{where} {broken}"]
    fp = rec.payload["fingerprint"]
    out = []
    if fp.get("cell_sha256") is None:
        out.append(f"{where} was not produced by a notebook cell (sealed outside IPython)")
    elif fp["cell_sha256"] != cell_sha256(cell.get("source", "")):
        out.append(f"{where}: the cell's code changed after it produced this result, or the result was "
                   f"moved here; re-run the cell")
    elif fp.get("execution_count") != cell.get("execution_count"):
        out.append(f"{where} comes from execution [{fp.get('execution_count')}] but the cell shows "
                   f"[{cell.get('execution_count')}] (output pasted from another run); re-run the cell")
    if rec.kind == "run" and isinstance(rec.payload.get("record"), dict):
        device = str((fp.get("env") or {}).get("device", ""))
        try:
            impossible = physical_problems(rec.payload["record"], device)
        except (TypeError, ValueError) as exc:
            impossible = [f"the record holds malformed numbers ({exc})"]
        out += [f"{where}: physically impossible: {p}" for p in impossible]
    return out


def rehearsed(nb) -> str | None:
    """'cell N: run|answer KEY' of the first payload a rehearsal recorded (labkit.runtime.rehearsal), else None.
    The seal's environment says so (and its digest covers it), and so does a rehearsal's RunRecord."""
    for rec in collect(nb):
        fp = rec.payload.get("fingerprint") or {}
        record = rec.payload.get("record") if isinstance(rec.payload.get("record"), dict) else {}
        if (fp.get("env") or {}).get("rehearsal") or record.get("rehearsal"):
            return f"cell {cell_number(nb, rec.cell)}: {rec.kind or 'result'} {rec.key!r}"
    return None


def problems(nb, *, seals_only: bool = False) -> list[str]:
    """All integrity problems of a notebook's labkit payloads. `seals_only` keeps just forged or edited
    seals (what still matters when the notebook will be re-executed anyway)."""
    out = []
    for rec in collect(nb):
        number = cell_number(nb, rec.cell)
        if seals_only:
            broken = seal_problem(rec.payload, rec.text)
            if broken:
                out.append(f"cell {number}: {rec.kind or 'result'} {rec.key!r} {broken}")
        else:
            out += payload_problems(rec, nb.cells[rec.cell], number)
    return out
