"""Tables and figures for notebooks 02 and 03: levers side by side, and scaling efficiency.

Pure functions of `RunRecord`s (plus matplotlib for the figures), so the notebooks stay thin.
Introduced in notebooks 02_single_gpu and 03_ddp.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from labkit.results import RunRecord

#: NVIDIA Deep Learning Examples, ResNet-50 v1.5 training on DGX A100 (80 GB), PyTorch: 1 GPU with AMP
#: 2470 img/s, with TF32 938 img/s; 8 GPUs with AMP train 6.72x faster than 1 GPU.
NVIDIA_RESNET50_A100 = {"amp_1gpu_img_s": 2470.0, "tf32_1gpu_img_s": 938.0, "amp_8gpu_speedup": 6.72}


def lever_rows(runs: Mapping[str, RunRecord]) -> list[dict]:
    """One row per labelled run: throughput, step time, epoch projection, peak memory, final loss."""
    rows = []
    for label, r in runs.items():
        rows.append({"run": label, "samples_per_s": round(r.samples_per_s, 1),
                     "step_ms": round(r.step_time_s * 1e3, 1), "epoch_min": round(r.extra["epoch_time_s"] / 60, 2),
                     "peak_MiB": round(max(r.peak_bytes) / 2**20, 1), "final_loss": round(r.losses[-1], 4)})
    return rows


def lever_chart(runs: Mapping[str, RunRecord], *, title: str = "single-device levers"):
    """Figure: throughput and peak memory per run, each relative to the first (the baseline)."""
    import matplotlib.pyplot as plt

    labels = list(runs)
    base = runs[labels[0]]
    speed = [r.samples_per_s / base.samples_per_s for r in runs.values()]
    memory = [max(r.peak_bytes) / max(base.peak_bytes) for r in runs.values()]
    fig, (ax_s, ax_m) = plt.subplots(1, 2, figsize=(11, 3.8))
    ax_s.bar(labels, speed, color="tab:blue")
    ax_m.bar(labels, memory, color="tab:orange")
    for ax, name in ((ax_s, "throughput"), (ax_m, "peak memory")):
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set(title=f"{name} / baseline", ylabel="x baseline")
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def scaling_rows(runs: Sequence[RunRecord]) -> list[dict]:
    """Speedup and scaling efficiency (speedup / ranks) against the 1-rank run, per world size."""
    base = min(runs, key=lambda r: r.world_size)
    return [{"ranks": r.world_size, "strategy": r.strategy, "samples_per_s": round(r.samples_per_s, 1),
             "per_rank_batch": r.global_batch // r.world_size,
             "speedup": round(r.samples_per_s / base.samples_per_s, 3),
             "efficiency": round(r.samples_per_s / base.samples_per_s / (r.world_size / base.world_size), 3)}
            for r in sorted(runs, key=lambda r: r.world_size)]


def scaling_chart(runs: Sequence[RunRecord], *, reference: Mapping[str, float] = NVIDIA_RESNET50_A100):
    """Figure: measured speedup vs ranks, the ideal line, and NVIDIA's published A100 ResNet-50 point."""
    import matplotlib.pyplot as plt

    rows = scaling_rows(runs)
    ranks = [row["ranks"] for row in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    top = max(8, *ranks)
    ax.plot([1, top], [1, top], "--", color="gray", label="ideal (efficiency 1)")
    ax.plot(ranks, [row["speedup"] for row in rows], "o-", label="measured (this run, fixed global batch)")
    ax.plot([1, 8], [1, reference["amp_8gpu_speedup"]], "s:", color="tab:green",
            label=f"NVIDIA ResNet-50 A100 AMP ({reference['amp_8gpu_speedup'] / 8:.0%} at 8 GPUs)")
    ax.set(xlabel="ranks", ylabel="speedup over 1 rank", title="DDP scaling")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
