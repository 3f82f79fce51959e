"""Per-rank load bars of notebook 09_beyond_3d: the causal work of each context-parallel split, the rows each
expert-parallel rank received from the dispatch all-to-all (numbers from `labkit.parallel.context_variants`
and `labkit.zoo.moe`)."""
from __future__ import annotations


def load_bars(series: dict[str, list[float]], *, ylabel: str, title: str = "", ax=None):
    """Grouped bars, one group per rank, one bar per entry of `series` (name -> per-rank values), with the
    mean of each as a dashed line: the gap between the tallest bar and its mean is the step's wait."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(5, 3))
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = np.arange(len(values)) + i * width
        bars = ax.bar(xs, values, width, label=name)
        ax.hlines(sum(values) / len(values), xs[0] - width / 2, xs[-1] + width / 2, colors=bars[0].get_facecolor(),
                  linestyles="dashed", lw=1)
    ranks = len(next(iter(series.values()), []))
    ax.set_xticks(np.arange(ranks) + width * (len(series) - 1) / 2, [f"rank {r}" for r in range(ranks)])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return fig or ax.figure
