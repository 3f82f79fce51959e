"""Figures of collective communication, drawn from the algorithms' own tables (matplotlib, Agg-safe):

- `ring_allreduce_plan` / `ring_allreduce_steps`: who sends which chunk at each of the 2 (N-1) steps
  (Patarasuk & Yuan 2009); `allreduce_traffic`: bytes per rank, ring vs one reducing rank (03_ddp).
- `plot_bandwidth`: measured bus / algorithm bandwidth vs message size (`labkit.profiling.commbench`,
  09_beyond_3d).

Each drawing function returns a Figure and never calls plt.show(). The other lecture figures are in
`labkit.viz.figures` and `labkit.viz.simulated_schedule`; `labkit.viz.plots` re-exports them all.
"""
from __future__ import annotations

from labkit.errors import ConfigError
from labkit.parallel import comm
from labkit.viz.figures import RANK_COLORS, _axes, _positive


# ----------------------------------------------------------------------------- ring all-reduce
def ring_allreduce_plan(n: int) -> list[dict]:
    """The 2 (n - 1) steps of a ring all-reduce over n ranks, each {'phase', 'sends': [(src, dst, chunk)]}.

    The buffer is cut into n chunks. Reduce-scatter step s: rank r sends chunk (r - s) mod n to r + 1,
    which adds it to its own; after n - 1 steps rank r owns the full sum of chunk (r + 1) mod n. The
    all-gather then passes the finished chunks around the ring (Patarasuk & Yuan 2009, Sec. 3)."""
    _positive(n=n)
    steps = []
    for s in range(n - 1):
        steps.append({"phase": "reduce-scatter", "sends": [(r, (r + 1) % n, (r - s) % n) for r in range(n)]})
    for s in range(n - 1):
        steps.append({"phase": "all-gather", "sends": [(r, (r + 1) % n, (r + 1 - s) % n) for r in range(n)]})
    return steps


def simulate_ring_allreduce(values: list[list[float]]) -> tuple[list[list[float]], list[list[list[frozenset]]]]:
    """Run the plan on values[rank][chunk]; returns (final values, contributors per step).

    contributors[t][rank][chunk] is the set of ranks whose data chunk holds after step t (t = 0 is
    the start), which is what `ring_allreduce_steps` colours."""
    n = len(values)
    if n < 1 or any(len(row) != n for row in values):
        raise ConfigError(f"values must be an n x n list (n ranks x n chunks); got {len(values)} ranks")
    vals = [list(map(float, row)) for row in values]
    who = [[frozenset({r}) for _ in range(n)] for r in range(n)]
    history = [[row[:] for row in who]]
    for step in ring_allreduce_plan(n):
        # every rank sends at once: read all outgoing chunks before anyone writes
        out = [(src, dst, c, vals[src][c], who[src][c]) for src, dst, c in step["sends"]]
        for _, dst, c, v, w in out:
            if step["phase"] == "reduce-scatter":
                vals[dst][c] += v
                who[dst][c] = who[dst][c] | w
            else:
                vals[dst][c], who[dst][c] = v, w
        history.append([row[:] for row in who])
    return vals, history


def ring_allreduce_steps(n: int = 4):
    """One panel per step: n ranks (rows) x n chunks (columns), shaded by how many ranks each holds;
    the chunks sent in that step are outlined. Returns the Figure."""
    import matplotlib.pyplot as plt

    _positive(n=n)
    if n < 2:
        raise ConfigError("a ring all-reduce needs n >= 2 ranks")
    _, history = simulate_ring_allreduce([[0.0] * n for _ in range(n)])
    plan = ring_allreduce_plan(n)
    cols = n  # start + (n - 1) reduce-scatter steps on the first row, the all-gather on the second
    fig, axes = plt.subplots(2, cols, figsize=(2.4 * cols, 5.0))
    cmap = plt.get_cmap("Blues")
    panels = [(0, 0, "start", None)]
    for t, step in enumerate(plan):
        row, col = (0, t + 1) if t < n - 1 else (1, t - (n - 1) + 1)
        panels.append((row, col, f"{step['phase']} {t % (n - 1) + 1}", step))
    axes[1][0].axis("off")
    axes[1][0].text(0.5, 0.5, f"per rank: sends\n2(N-1)/N x S\n= {comm.bus_factor('all_reduce', n):.2f} S",
                    ha="center", va="center", fontsize=11)
    for idx, (row, col, label, step) in enumerate(panels):
        a = axes[row][col]
        state = history[idx]
        sent = {(src, c) for src, _, c in step["sends"]} if step else set()
        for r in range(n):
            for c in range(n):
                k = len(state[r][c])
                a.add_patch(plt.Rectangle((c, n - 1 - r), 0.94, 0.9, color=cmap(0.15 + 0.8 * k / n)))
                a.text(c + 0.47, n - 1 - r + 0.45, "all" if k == n else "".join(map(str, sorted(state[r][c]))),
                       ha="center", va="center", fontsize=8, color="white" if k > n / 2 else "black")
                if (r, c) in sent:
                    a.add_patch(plt.Rectangle((c, n - 1 - r), 0.94, 0.9, fill=False, lw=2.2, ec="#C44E52"))
        a.set_xlim(0, n)
        a.set_ylim(0, n)
        a.set_xticks([c + 0.47 for c in range(n)], [f"c{c}" for c in range(n)], fontsize=7)
        a.set_yticks([n - 1 - r + 0.45 for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=7)
        a.set_title(label, fontsize=9)
        a.tick_params(length=0)
        for spine in a.spines.values():
            spine.set_visible(False)
    fig.suptitle(f"Ring all-reduce, {n} ranks: cell = ranks summed into that chunk; red = sent to rank+1",
                 fontsize=11)
    fig.tight_layout()
    return fig


def allreduce_traffic(max_ranks: int = 64, *, ax=None):
    """Bytes each rank sends (in units of the gradient size S): ring 2 (N-1)/N vs one reducing rank
    that receives (N-1) S and sends it back (the parameter-server bottleneck the ring avoids)."""
    _positive(max_ranks=max_ranks)
    fig, a = _axes(ax, (6.0, 3.6))
    ns = list(range(2, max_ranks + 1))
    a.plot(ns, [comm.bus_factor("all_reduce", n) for n in ns], lw=2.5, color=RANK_COLORS[0],
           label="ring: every rank sends 2(N-1)/N x S")
    a.plot(ns, [2 * (n - 1) for n in ns], lw=2.5, color=RANK_COLORS[3], label="one reducing rank: 2(N-1) x S")
    a.set_yscale("log")
    a.set_xlabel("ranks N")
    a.set_ylabel("bytes on the busiest link / S")
    a.set_title("All-reduce traffic per rank (bandwidth term)")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- measured bandwidth
def plot_bandwidth(rows: list[CommMeasurement], *, ax=None, which: str = "busbw"):
    """Bus (or algorithm) bandwidth vs message size, one line per collective (rows of
    `labkit.profiling.commbench.measure`); returns the Figure. Introduced in notebook 09_beyond_3d."""
    from labkit.errors import choices_error
    from labkit.profiling.commbench import OPS

    if which not in ("busbw", "algbw"):
        raise choices_error("bandwidth", which, ("busbw", "algbw"))
    fig, a = _axes(ax, (6.5, 3.8))
    for color, op in zip(RANK_COLORS, OPS):
        mine = sorted((r for r in rows if r.op == op), key=lambda r: r.bytes)
        if mine:
            a.plot([r.bytes for r in mine], [getattr(r, f"{which}_gbps") for r in mine], "o-", lw=2,
                   color=color, label=op)
    a.set_xscale("log", base=2)
    a.set_xlabel("message size S (bytes)")
    a.set_ylabel(f"{which} (GB/s)")
    n = rows[0].world_size if rows else "?"
    backend = rows[0].backend if rows else ""
    a.set_title(f"collective {which} vs size: {n} ranks, {backend}")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    fig.tight_layout()
    return fig
