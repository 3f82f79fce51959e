"""Fit the time model's few constants to the calibration rows, and cross-validate them source by source.

Pure Python. The constants (`labkit.parallel.hardware.CONSTANTS`) each have a physical meaning: the share of
the dense peak an A100 / an H100 reaches on the arithmetic of the model's GEMMs (their HBM traffic is priced
separately, `labkit.parallel.perf_ops`), the share of that rate a torch-native stack's linears reach on an H100
(`hardware.stack_efficiency`), the share of NVLink's data-sheet bandwidth NCCL reaches, and the share of an
overlapped collective that really runs concurrently. Everything else the time model uses is measured
elsewhere and stated (kernel efficiencies, HBM, the MAMF ceilings), so the fit cannot bend it to a source. `fit` minimizes the mean squared log error in tokens/s per GPU over the rows marked
`calibration` that count (coordinate descent, golden-section search per constant in [0.3, 1]);
`leave_one_source_out` refits without each source in turn and predicts that source's rows, calibration and
held-out alike -- the error a run the model was never fitted on should expect. `bench/planner_heldout.py`
prints both. Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

import contextlib
import math

from labkit.parallel import hardware, published_runs

BOUNDS = (0.3, 1.0)
#: Communication constants the fit moves (the others stay the stated assumptions of labkit.parallel.hardware).
FITTED_COMM = ("comm_efficiency.nvlink", "overlap_efficiency")
#: Where every fit starts (the values before issue 27's fit: the A100 default of issue 19, nccl-tests' NVLink
#: share, the network's line-rate share, a guess for the overlap), so a refit is deterministic.
PRIOR = {"matmul_efficiency.a100": 0.72, "matmul_efficiency.h100": 0.72, "matmul_efficiency.v100": 0.72,
         "comm_efficiency.nvlink": 0.75,
         "comm_efficiency.network": 0.9, "overlap_efficiency": 0.65, "stack_efficiency.h100": 1.0}
PHI = (math.sqrt(5) - 1) / 2


@contextlib.contextmanager
def using(constants: dict):
    """Run the model with `constants` in place of `hardware.CONSTANTS` (restored afterwards)."""
    saved = dict(hardware.CONSTANTS)
    hardware.CONSTANTS.update(constants)
    try:
        yield
    finally:
        hardware.CONSTANTS.clear()
        hardware.CONSTANTS.update(saved)


def errors(rows, constants: dict) -> list[dict]:
    """`compare()` of `rows` under `constants`."""
    with using(constants):
        return [r.compare() for r in rows]


def _loss(rows, constants: dict) -> float:
    errs = errors(rows, constants)
    return sum(math.log(1 + e["rel_err"]) ** 2 for e in errs) / len(errs)


def free_constants(rows) -> list[str]:
    """The constants these rows can determine: a GPU family's efficiency only if a row ran on it (its
    torch-native stack efficiency only if a torch-native row did); a communication constant only if moving it
    by +-0.05 moves the rows' loss (else it keeps its prior)."""
    families = {hardware.gpu_family(r.gpu) for r in rows}
    torch = {{"h200": "h100"}.get(f, f) for f in (hardware.gpu_family(r.gpu) for r in rows if r.layout().stack != "megatron")}
    out = [k for k in hardware.CONSTANTS if k.startswith("matmul_efficiency.") and k.split(".")[1] in families]
    out += [k for k in hardware.CONSTANTS if k.startswith("stack_efficiency.") and k.split(".")[1] in torch]
    base = dict(hardware.CONSTANTS)
    for key in FITTED_COMM:
        lo, hi = max(BOUNDS[0], base[key] - 0.05), min(BOUNDS[1], base[key] + 0.05)
        if abs(_loss(rows, {**base, key: lo}) - _loss(rows, {**base, key: hi})) > 1e-6:
            out.append(key)
    return out


def fit(rows=None, *, rounds: int = 2, iterations: int = 18) -> dict:
    """Constants minimizing the mean squared log error over `rows` (default: the counted calibration rows).

    Two stages: the GPU and fabric constants on the fused-stack (Megatron/TE) rows, then each torch-native
    stack efficiency on the torch-native rows with those held -- a torch-native row measures its stack against
    the GPU, not the GPU itself. A family's efficiency with no row to fit keeps the A100's fitted value (said
    in `leave_one_source_out`); a stack efficiency with no row keeps 1.0."""
    rows = [r for r in (rows if rows is not None else published_runs.runs(calibration_only=True)) if r.counts]
    fused = [r for r in rows if r.layout().stack == "megatron"]
    best = dict(PRIOR)
    with using(PRIOR):
        gpus = free_constants(fused)
    for stage in (fused, [r for r in rows if r not in fused]):
        if not stage:
            continue
        with using(PRIOR):
            free = [k for k in free_constants(stage) if k.startswith("stack_") == (stage is not fused)]
        for _ in range(rounds):
            for key in free:
                best[key] = _golden(lambda x: _loss(stage, {**best, key: x}), iterations)
    for key in hardware.CONSTANTS:
        if key.startswith("matmul_efficiency.") and key not in gpus:
            best[key] = best["matmul_efficiency.a100"]
    return best


def _golden(f, iterations: int) -> float:
    """Golden-section search of f's minimum on BOUNDS (one new evaluation per iteration)."""
    lo, hi = BOUNDS
    a, b = hi - PHI * (hi - lo), lo + PHI * (hi - lo)
    fa, fb = f(a), f(b)
    for _ in range(iterations):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - PHI * (hi - lo)
            fa = f(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + PHI * (hi - lo)
            fb = f(b)
    return round((lo + hi) / 2, 3)


def leave_one_source_out(rows=None) -> list[dict]:
    """Per source: the constants fitted without it and the errors on all of its rows."""
    rows = rows if rows is not None else published_runs.runs()
    out = []
    for source in sorted({r.source for r in rows}):
        train = [r for r in rows if r.calibration and r.source != source and r.counts]
        constants = fit(train)
        missing = [k for k in hardware.CONSTANTS if k.startswith("matmul_efficiency.") and k not in free_constants(train)]
        for e in errors([r for r in rows if r.source == source], constants):
            out.append({**e, "constants": constants, "unfitted": missing})
    return out


def summary(errs: list[dict]) -> dict:
    """Count, median and worst absolute error and the share within 20 % of the counted rows."""
    counted = sorted(abs(e["rel_err"]) for e in errs if e["counts"])
    if not counted:
        return {"rows": 0}
    mid = len(counted) // 2
    median = counted[mid] if len(counted) % 2 else (counted[mid - 1] + counted[mid]) / 2
    return {"rows": len(counted), "within_20": sum(c <= 0.2 for c in counted), "median": median,
            "worst": counted[-1]}


def gpu_count_slope(errs: list[dict]) -> float:
    """Least-squares slope of log(predicted / published) on sqrt(2 ln N), N a row's GPUs (`errors()` rows).

    A straggler term -- every step waits for the slowest of N GPUs, each with a per-GPU step jitter sigma, and
    E[max of N normals] ~ sigma sqrt(2 ln N) -- would take out a slope of sigma; a slope near 0 says the rows
    show no slowdown with scale that the model misses (issue 42, docs/model_parallel.md)."""
    xs = [math.sqrt(2 * math.log(e["gpus"])) for e in errs]
    ys = [math.log(1 + e["rel_err"]) for e in errs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
