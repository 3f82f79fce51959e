"""Course figures (matplotlib). Each function returns a Figure and never calls plt.show().

- `memory_stack`: where one GPU's memory goes — stacked weights / grads / optimizer / activations
  bars against GPU capacity lines (notebook 01_memory).
- The lecture figures of `labkit.viz.figures` (ZeRO partitioning, checkpointing, tensor splits,
  3-D layouts, LoRA, the planner's layouts), `labkit.viz.collectives` (ring all-reduce) and
  `labkit.viz.simulated_schedule` (pipeline schedules), re-exported so notebooks and slides
  import every course figure from one place.
"""
from __future__ import annotations

from typing import Mapping

from labkit.viz.collectives import allreduce_traffic, ring_allreduce_steps  # noqa: F401
from labkit.viz.figures import (checkpointing_tradeoff, lora_update, parallel_layout, plan_chart,  # noqa: F401
                            tensor_split, zero_partitioning)
from labkit.viz.simulated_schedule import pipeline_schedule  # noqa: F401
from labkit.memory.report import GPU_CAPACITIES, PARTS

_COLORS = {"weights": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52"}


def memory_stack(results: Mapping[str, object], *, capacities: Mapping[str, float] | None = None,
                 title: str = "memory per GPU", ax=None):
    """Stacked bar per label (an `Estimate` each) in GB (10^9 B) with dashed capacity lines.

    A bar from a trace or measurement also gets a black tick at its observed peak ('total')."""
    import matplotlib.pyplot as plt

    capacities = GPU_CAPACITIES if capacities is None else capacities
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(results) + 3), 4.2))
    else:
        fig = ax.figure
    labels = list(results)
    bottom = [0.0] * len(labels)
    for part in PARTS:
        heights = [getattr(results[k], part) / 1e9 for k in labels]
        ax.bar(labels, heights, bottom=bottom, label=part, color=_COLORS[part])
        bottom = [b + h for b, h in zip(bottom, heights)]
    peak_label = "observed peak"
    for i, key in enumerate(labels):
        est = results[key]
        if getattr(est, "source", "estimate") != "estimate":
            ax.plot([i - 0.4, i + 0.4], [est.total / 1e9] * 2, color="black", lw=2, label=peak_label)
            peak_label = None  # one legend entry
    top = max(bottom + [1e-9])
    for name, cap in capacities.items():
        if cap / 1e9 <= 1.6 * top:  # only the lines that say something about these bars
            ax.axhline(cap / 1e9, ls="--", lw=1, color="gray")
            ax.text(len(labels) - 0.5, cap / 1e9, f" {name}", va="bottom", ha="right", fontsize=8)
    ax.set_ylabel("GB (10^9 bytes) per GPU")
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=20)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig
