"""The roofline figure of notebook 08_profiling_and_stacking: attainable FLOP/s against arithmetic intensity,
one point per operator of a transformer layer (numbers from `labkit.profiling.roofline`)."""
from __future__ import annotations


def roofline_figure(rows: list[dict], peak_flops: float, bandwidth: float, *, title: str = "", ax=None):
    """Log-log roofline min(peak, I x bandwidth) with `rows` (`roofline.table`) placed at their intensity."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3.8))
    intensities = [r["FLOP/B"] for r in rows]
    xs = np.logspace(np.log10(min(intensities) / 2), np.log10(max(intensities) * 2), 200)
    ax.loglog(xs, np.minimum(peak_flops, xs * bandwidth) / 1e12, color="black", lw=1.5)
    ax.axvline(peak_flops / bandwidth, color="gray", ls=":", lw=1)
    for r in rows:
        y = min(peak_flops, r["FLOP/B"] * bandwidth) / 1e12
        ax.scatter(r["FLOP/B"], y, color="tab:red" if r["bound"] == "memory" else "tab:blue", zorder=3)
        ax.annotate(r["op"], (r["FLOP/B"], y), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(title or f"ridge at {peak_flops / bandwidth:.0f} FLOP/B")
    return fig or ax.figure
