"""Printing estimates: the human table (units spelled out) and the GPU capacities we compare against.

GB means 10^9 bytes and GiB 2^30 bytes; GPU memory is sold in GiB ("80 GB" A100 = 81,920 MiB).
Pure Python. Introduced in notebook 01_memory.
"""
from __future__ import annotations

from labkit.memory.estimate import Estimate

GB, GIB = 10**9, 2**30
PARTS = ("weights", "grads", "optimizer", "activations")

#: Device memory in bytes, as `nvidia-smi` reports the total (MiB * 2^20). THE one definition: notebooks,
#: grading checks and `labkit.profiling.oom` read it from here. Vendors' "24 GB" for an RTX 4090 means 24 GiB of
#: GDDR6X: nvidia-smi shows 24,564 MiB (= 25.76 * 10^9 B), so the 4090 is 24,564 MiB, not 24 * 10^9 B.
GPU_CAPACITIES = {
    "T4 16GB": 15_360 * 2**20,
    "RTX 4090 24GB": 24_564 * 2**20,
    "V100 32GB": 32_768 * 2**20,
    "A100 40GB": 40_960 * 2**20,
    "A100 80GB": 81_920 * 2**20,
    "H100 80GB": 81_559 * 2**20,
}


def gb(n: float) -> float:
    return n / GB


def gib(n: float) -> float:
    return n / GIB


def rows(est: Estimate) -> list[tuple[str, int]]:
    """(part, bytes) rows of one estimate, total last, host memory after it."""
    out = [(p, getattr(est, p)) for p in PARTS]
    out.append(("total" if est.source == "estimate" else "total (peak)", est.total))
    out.append(("cpu (host)", est.cpu_bytes))
    return out


def format_table(est: Estimate, *, title: str = "") -> str:
    """Fixed-width table: bytes, GB (10^9 B) and GiB (2^30 B) per part, then the assumptions."""
    head = title or f"{est.source}: {est.params:,} params, {est.trainable_params:,} trainable"
    lines = [head, f"{'per GPU':<14}{'bytes':>20}{'GB (10^9 B)':>14}{'GiB (2^30 B)':>14}"]
    for name, value in rows(est):
        lines.append(f"{name:<14}{value:>20,}{gb(value):>14.3f}{gib(value):>14.3f}")
    lines.append("fits on: " + (", ".join(n for n, cap in GPU_CAPACITIES.items() if est.fits(cap)) or "none of "
                                + ", ".join(GPU_CAPACITIES)))
    lines += [f"  - {a}" for a in est.assumptions]
    return "\n".join(lines)


def compare_rows(results: dict[str, Estimate]) -> list[dict]:
    """One row per part with each source's GB, e.g. {'part': 'weights', 'estimate': 0.1, 'trace': 0.1}."""
    table = []
    for part in PARTS + ("model_states", "total"):
        row = {"part": part}
        for label, est in results.items():
            row[label] = round(gb(getattr(est, part)), 6)
        table.append(row)
    return table


def format_compare(results: dict[str, Estimate]) -> str:
    labels = list(results)
    lines = [f"{'GB (10^9 B)':<14}" + "".join(f"{lab:>14}" for lab in labels)]
    for row in compare_rows(results):
        lines.append(f"{row['part']:<14}" + "".join(f"{row[lab]:>14.6f}" for lab in labels))
    return "\n".join(lines)
