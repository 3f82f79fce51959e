"""Figures of a class's gradebook (labkit.course.grading.report: OUT_DIR/report.html). Plain numbers in,
a matplotlib Figure out; nothing here reads a notebook or computes a grade.

- `score_histograms`: the score distribution of each lab, out of its points possible;
- `speedup_vs_gpus`: each student's measured speedup over their own 1-GPU run of the same strategy, beside
  the ideal (linear) line;
- `peak_memory_by_strategy`: each recorded run's peak memory per GPU, one column per strategy.
"""
from __future__ import annotations

from typing import Mapping, Sequence


def _figure(width: float = 6.0, height: float = 3.4):
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    fig = Figure(figsize=(width, height), dpi=100)
    return fig, fig.add_subplot()


def score_histograms(scores: Mapping[str, Sequence[float]], maxima: Mapping[str, float]):
    """One histogram per notebook of `scores` (its rows' scores), the x axis from 0 to its maximum."""
    n = max(len(scores), 1)
    fig, _ = _figure(6.0, 2.2 * n)
    fig.clear()
    for i, (notebook, values) in enumerate(sorted(scores.items()), 1):
        ax = fig.add_subplot(n, 1, i)
        most = float(maxima.get(notebook, max(values, default=1.0))) or 1.0
        ax.hist(values, bins=min(20, max(5, int(most))), range=(0, most), color="#4C72B0", edgecolor="white")
        ax.set_title(f"{notebook}: {len(values)} rows, mean {sum(values) / max(len(values), 1):.1f} / {most:g}",
                     fontsize=9)
        ax.set_ylabel("students")
    fig.axes[-1].set_xlabel("score") if fig.axes else None
    fig.tight_layout()
    return fig


def speedup_vs_gpus(points: Sequence[tuple[str, int, float]]):
    """(strategy, GPUs, speedup over 1 GPU) per run: one marker colour per strategy, the ideal line dashed."""
    fig, ax = _figure()
    strategies = sorted({s for s, _, _ in points})
    for strategy in strategies:
        xs = [g for s, g, _ in points if s == strategy]
        ys = [v for s, _, v in points if s == strategy]
        ax.scatter(xs, ys, label=strategy, alpha=0.7)
    top = max((g for _, g, _ in points), default=1)
    ax.plot([1, top], [1, top], "k--", linewidth=1, label="ideal")
    ax.set_xlabel("GPUs (ranks)")
    ax.set_ylabel("speedup over the student's 1-GPU run")
    ax.legend(fontsize=8)
    ax.set_title("speedup vs GPUs (the class's recorded runs)", fontsize=10)
    fig.tight_layout()
    return fig


def peak_memory_by_strategy(points: Sequence[tuple[str, float]]):
    """(strategy, peak GiB per GPU) per run: the runs of each strategy side by side."""
    fig, ax = _figure()
    strategies = sorted({s for s, _ in points})
    for i, strategy in enumerate(strategies):
        ys = [v for s, v in points if s == strategy]
        ax.scatter([i] * len(ys), ys, alpha=0.6)
    ax.set_xticks(range(len(strategies)), strategies, rotation=30, ha="right")
    ax.set_ylabel("peak memory per GPU (GiB)")
    ax.set_title("peak memory per strategy (the class's recorded runs)", fontsize=10)
    fig.tight_layout()
    return fig
