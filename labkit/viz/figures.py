"""Lecture and notebook figures drawn from the algorithms' own tables (matplotlib, Agg-safe): memory,
recomputation, tensor splits, layouts, LoRA, the planner's choices. Collectives are drawn by
`labkit.viz.collectives`, simulated pipeline schedules by `labkit.viz.simulated_schedule`; both use this
module's colours and checks, and `labkit.viz.plots` re-exports every lecture figure.

Each drawing function returns a Figure and never calls plt.show(); the data behind it comes from a
small pure-Python function the tests check against the papers:

- `zero_partitioning`: what each GPU keeps under ZeRO stages 0-3 (Rajbhandari et al. 2020, Fig. 1),
  bytes from `labkit.memory.estimate` (04_fsdp, 05_zero).
- `checkpointing_tradeoff`: sqrt(n) segments, k + n/k activations for one extra forward (Chen et al.
  2016) (02_single_gpu).
- `plan_chart`: the planner's best layouts, step time split by compute and communication (07_model_parallel).
- `tensor_split`: Megatron column/row splits of the MLP and attention (Shoeybi et al. 2019).
- `parallel_layout`: which GPU holds which (pp, dp, tp) coordinate on 8-GPU nodes (07_model_parallel).
- `lora_update`: W + B A with its parameter counts (Hu et al. 2022) (06_peft).
"""
from __future__ import annotations

import math

from labkit.errors import ConfigError

RANK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")
STATE_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868"}
IDLE = "#EEEEEE"


def _positive(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}={value!r}; it must be a positive integer")


def _axes(ax, size):
    """(figure, axes): the given axes' figure, or a new single-panel figure of `size` inches."""
    import matplotlib.pyplot as plt

    return (ax.figure, ax) if ax is not None else plt.subplots(figsize=size)


# ----------------------------------------------------------------------------- ZeRO
def zero_partitioning(gpus: int = 4, *, params: int = 7_500_000_000, dp: int = 64, ax=None):
    """ZeRO paper Fig. 1: per stage, what each of `gpus` drawn GPUs keeps of the 2 + 2 + 12 B/param
    model states; the labels give GB per GPU for `params` parameters over `dp` ranks, from
    `labkit.memory.estimate` (mixed-precision AdamW, K = 12)."""
    import matplotlib.pyplot as plt

    from labkit.memory.estimate import MemoryConfig, estimate

    _positive(gpus=gpus, params=params, dp=dp)
    fig, a = _axes(ax, (11.0, 4.6))
    widths = {"params": 2, "grads": 2, "optimizer": 12}
    names = ("baseline (DDP)", "ZeRO-1: P_os", "ZeRO-2: P_os+g", "ZeRO-3: P_os+g+p")
    gap = 1.5
    for stage, name in enumerate(names):
        y = len(names) - 1 - stage
        sharded = {"optimizer": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
        for g in range(gpus):
            x = g * (sum(widths.values()) + gap)
            for part, w in widths.items():
                a.add_patch(plt.Rectangle((x, y), w, 0.7, fill=False, ec="#999999", lw=0.6))
                if sharded[part]:  # this GPU keeps only its 1/N slice of the part
                    a.add_patch(plt.Rectangle((x + g * w / gpus, y), w / gpus, 0.7, color=STATE_COLORS[part]))
                else:
                    a.add_patch(plt.Rectangle((x, y), w, 0.7, color=STATE_COLORS[part]))
                x += w
        est = estimate(MemoryConfig(params=params, zero=stage, dp=dp))
        a.text(-0.6, y + 0.35, name, ha="right", va="center", fontsize=10)
        a.text(gpus * (16 + gap), y + 0.35, f"{est.model_states / 1e9:.1f} GB", va="center", fontsize=10,
               fontweight="bold")
    for g in range(gpus):
        a.text(g * (16 + gap) + 8, len(names) - 0.15, f"GPU {g}", ha="center", fontsize=9)
    for i, (part, color) in enumerate(STATE_COLORS.items()):
        label = {"params": "bf16 params 2Ψ", "grads": "bf16 grads 2Ψ", "optimizer": "fp32 Adam states 12Ψ"}[part]
        a.add_patch(plt.Rectangle((i * 16, -0.9), 1.2, 0.4, color=color))
        a.text(i * 16 + 1.5, -0.7, label, va="center", fontsize=9)
    a.set_xlim(-14, gpus * (16 + gap) + 6)
    a.set_ylim(-1.1, len(names) + 0.1)
    a.axis("off")
    a.set_title(f"ZeRO partitioning: drawn for {gpus} GPUs; memory per GPU for Ψ = {params / 1e9:g}B, "
                f"N_d = {dp}", fontsize=11)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- checkpointing
def checkpoint_memory(layers: int, segments: int) -> int:
    """Peak activations, in layer-activation units, with `segments` checkpointed segments (Chen et al.
    2016, Sec. 3): the k segment inputs are kept, plus one segment's n/k layers during its recompute."""
    _positive(layers=layers, segments=segments)
    if segments > layers:
        raise ConfigError(f"segments={segments} > layers={layers}: a segment holds at least one layer")
    return segments + math.ceil(layers / segments)


def checkpointing_tradeoff(layers: int = 36):
    """Left: peak activation memory vs number of segments k (minimum at k = sqrt(n)); right: the step's
    compute, forward 1 + backward 2 units, plus one recomputed forward with checkpointing."""
    _positive(layers=layers)
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10.0, 3.8))
    ks = list(range(1, layers + 1))
    a.plot(ks, [checkpoint_memory(layers, k) for k in ks], lw=2.5, color=RANK_COLORS[0],
           label="checkpoint k segments: k + n/k")
    a.axhline(layers, ls="--", color=RANK_COLORS[3], label=f"no checkpointing: n = {layers}")
    best = round(math.sqrt(layers))
    a.plot([best], [checkpoint_memory(layers, best)], "o", color="black")
    a.annotate(f"k = √n = {best}: {checkpoint_memory(layers, best)}", (best, checkpoint_memory(layers, best)),
               xytext=(best + 2, layers * 0.55), arrowprops={"arrowstyle": "->"}, fontsize=9)
    a.set_xlabel("segments k")
    a.set_ylabel("peak activations (layers' worth)")
    a.set_title(f"Memory: O(n) -> O(√n), n = {layers} layers", fontsize=10)
    a.legend(fontsize=8)
    a.set_ylim(0, layers * 1.25)
    parts = [("forward", 1, RANK_COLORS[0]), ("backward", 2, RANK_COLORS[1]), ("recompute fwd", 1, RANK_COLORS[2])]
    for i, label in enumerate(("no checkpointing", "checkpointing")):
        left = 0
        for name, units, color in parts[: 2 + i]:
            b.barh(i, units, left=left, color=color, label=name if i == 1 else None)
            left += units
        b.text(left + 0.05, i, f"{left} units", va="center", fontsize=9)
    b.set_yticks([0, 1], ["no checkpointing", "checkpointing"])
    b.set_xlim(0, 5)
    b.set_xlabel("compute per step (one forward = 1)")
    b.set_title("Compute: one extra forward, ~4/3 of the step", fontsize=10)
    b.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- the planner
def plan_chart(model: str = "gpt3-175b", gpus: int = 64, gpus_per_node: int = 8, *, gpu: str = "a100-80gb",
               top: int = 8, ax=None):
    """The planner's best layouts that fit (`labkit.parallel.planner.plan`): estimated step time split into
    compute (incl. bubble) and tp / pp / dp communication, labelled with GB per GPU."""
    from labkit.parallel import planner

    result = planner.plan(planner.PlanRequest(model=model, gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu))
    best = result.fits[:top]
    if not best:
        raise ConfigError(f"no layout of {model} fits {gpus} x {gpu}; see labkit.parallel.planner.format_plan")
    fig, a = _axes(ax, (10.0, 0.9 + 0.42 * len(best)))
    for i, o in enumerate(best):
        left = 0.0
        parts = [("compute + bubble", o.step_s - sum(o.comm_s.values()))] + [(k, v) for k, v in o.comm_s.items()]
        for j, (name, secs) in enumerate(parts):
            a.barh(i, secs, left=left, color=RANK_COLORS[j], label=name if i == 0 else None)
            left += secs
        a.text(left * 1.01, i, f"{o.memory_bytes / 1e9:.0f} GB/GPU, bubble {o.bubble:.1%}", va="center", fontsize=8)
    a.set_yticks(range(len(best)), [f"dp{o.dp} tp{o.tp} pp{o.pp} z{o.zero} m{o.microbatches}" for o in best],
                 fontsize=8)
    a.invert_yaxis()
    a.set_xlim(0, max(o.step_s for o in best) * 1.35)
    a.set_xlabel("estimated seconds per optimizer step")
    r = result.request
    a.set_title(f"labkit.parallel.planner: {model} on {gpus} x {gpu}, global batch {r.batch} x {r.seq}; "
                f"{len(result.fits)} fit, {len(result.too_big)} too big, {len(result.rejected)} rejected", fontsize=9)
    a.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- tensor parallel
def _matrix(a, x, y, w, h, *, parts=0, axis="col", label="", sub=""):
    """A matrix as a rectangle, split into `parts` rank-coloured slices by column or row (0 = replicated)."""
    import matplotlib.pyplot as plt

    if not parts:
        a.add_patch(plt.Rectangle((x, y), w, h, color="#BBBBBB", ec="black"))
    for p in range(parts):
        if axis == "col":
            a.add_patch(plt.Rectangle((x + p * w / parts, y), w / parts, h, color=RANK_COLORS[p], ec="white"))
        else:
            a.add_patch(plt.Rectangle((x, y + h - (p + 1) * h / parts), w, h / parts, color=RANK_COLORS[p], ec="white"))
    a.text(x + w / 2, y + h + 0.15, label, ha="center", va="bottom", fontsize=9)
    if sub:
        a.text(x + w / 2, y - 0.15, sub, ha="center", va="top", fontsize=8, color="#444444")


def tensor_split(tp: int = 2):
    """Megatron-LM's splits (Shoeybi et al. 2019, Fig. 3): MLP A by columns, B by rows; attention Q/K/V
    by heads (columns), the output projection by rows; one all-reduce (g) after each block half."""
    _positive(tp=tp)
    if tp > len(RANK_COLORS):
        raise ConfigError(f"tp={tp}: the figure colours up to {len(RANK_COLORS)} ranks; draw tp <= 8")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11.5, 5.2))
    rows = (("MLP", "X", "A: h x 4h", "GeLU(X A_i)", "B: 4h x h", "column-parallel", "row-parallel"),
            ("self-attention", "X", "Q,K,V: h x 3h", "heads / t per rank", "O: h x h", "split by heads",
             "row-parallel"))
    for a, (name, x_lbl, w1, mid, w2, s1, s2) in zip(axes, rows):
        _matrix(a, 0.0, 0.5, 1.2, 2.0, label=f"{x_lbl} (replicated)", sub="f: copy fwd, all-reduce bwd")
        a.text(1.6, 1.5, "x", fontsize=14, va="center")
        _matrix(a, 2.0, 1.0, 3.0, 1.0, parts=tp, axis="col", label=w1, sub=s1)
        a.text(5.4, 1.5, "=", fontsize=14, va="center")
        _matrix(a, 6.0, 0.5, 3.0, 2.0, parts=tp, axis="col", label=mid, sub="no communication")
        a.text(9.4, 1.5, "x", fontsize=14, va="center")
        _matrix(a, 10.0, 0.0, 1.0, 3.0, parts=tp, axis="row", label=w2, sub=s2)
        a.text(11.4, 1.5, "=", fontsize=14, va="center")
        for p in range(tp):  # each rank's partial sum, same shape as the output
            _matrix(a, 12.0 + 0.25 * p, 0.5 - 0.2 * p, 1.2, 2.0, parts=1 if p == 0 else 0)
            a.patches[-1].set_color(RANK_COLORS[p])
        a.text(12.6, 2.7, f"{tp} partial sums", ha="center", fontsize=9)
        a.annotate("", xy=(15.6, 1.5), xytext=(13.6 + 0.25 * tp, 1.5), arrowprops={"arrowstyle": "->", "lw": 2})
        a.text(14.8, 1.75, "g: all-reduce", ha="center", fontsize=9, color="#C44E52")
        _matrix(a, 15.8, 0.5, 1.2, 2.0, label="Y (replicated)")
        a.set_xlim(-0.3, 17.3)
        a.set_ylim(-0.9, 3.5)
        a.set_title(f"{name}, tensor parallel t = {tp}: each colour is one rank's slice", fontsize=10)
        a.axis("off")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- 3-D layout
def parallel_layout(dp: int, tp: int, pp: int, *, gpus: int | None = None, gpus_per_node: int = 8, ax=None):
    """Which GPU holds which (stage, replica, tp rank): tp varies fastest, then dp, then pp
    (Megatron-LM's default order), so a tp group that divides a node stays on its NVLink."""
    import matplotlib.pyplot as plt

    from labkit.memory.estimate import check_topology

    _positive(gpus_per_node=gpus_per_node)
    check_topology(dp, tp, pp, dp * tp * pp if gpus is None else gpus)  # "tp(8) * pp(8) * dp(8) = 512 != gpus(64)"
    gpus = dp * tp * pp
    nodes = math.ceil(gpus / gpus_per_node)
    fig, a = _axes(ax, (1.0 + 1.05 * gpus_per_node, 0.6 + 0.62 * nodes))
    cmap = plt.get_cmap("tab10")
    for rank in range(gpus):
        t, d, s = rank % tp, rank // tp % dp, rank // (tp * dp)
        node, slot = divmod(rank, gpus_per_node)
        y = nodes - 1 - node
        a.add_patch(plt.Rectangle((slot, y), 0.92, 0.85, color=cmap(s % 10), alpha=0.35 + 0.65 * (d + 1) / dp))
        a.text(slot + 0.46, y + 0.42, f"s{s} d{d}\nt{t}", ha="center", va="center", fontsize=7)
    for group in range(gpus // tp):  # outline each tensor-parallel group
        first = group * tp
        node, slot = divmod(first, gpus_per_node)
        if slot + tp <= gpus_per_node:
            a.add_patch(plt.Rectangle((slot - 0.03, nodes - 1 - node - 0.03), tp - 0.02, 0.91, fill=False, lw=1.8))
    a.set_yticks([nodes - 1 - n + 0.42 for n in range(nodes)], [f"node {n}" for n in range(nodes)], fontsize=8)
    a.set_xticks([g + 0.46 for g in range(gpus_per_node)], [f"gpu {g}" for g in range(gpus_per_node)], fontsize=8)
    a.set_xlim(-0.1, gpus_per_node)
    a.set_ylim(-0.1, nodes)
    a.tick_params(length=0)
    for spine in a.spines.values():
        spine.set_visible(False)
    crosses = tp > gpus_per_node or gpus_per_node % tp
    a.set_title(f"TP={tp} x PP={pp} x DP={dp} = {gpus} GPUs (s = stage, d = replica, t = tp rank; boxes = TP "
                f"groups{' — TP group crosses nodes!' if crosses else ', inside a node'})", fontsize=9)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- LoRA
def lora_update(d: int = 4096, k: int = 4096, r: int = 8, *, ax=None):
    """h = W0 x + (alpha / r) B A x (Hu et al. 2022, Sec. 4.1): frozen W0 (d x k), trained B (d x r),
    A (r x k); B starts at 0 so training starts from the pretrained model."""
    import matplotlib.pyplot as plt

    _positive(d=d, k=k, r=r)
    fig, a = _axes(ax, (9.0, 3.8))
    side = 3.0
    wr = max(0.12, side * r / max(d, k) * 8)  # r is tiny: widen the drawing 8x so it stays visible
    a.add_patch(plt.Rectangle((0, 0), side * k / max(d, k), side * d / max(d, k), color="#BBBBBB"))
    a.text(side / 2, side / 2, f"W0\n{d} x {k}\nfrozen", ha="center", va="center", fontsize=10)
    a.text(side + 0.35, side / 2, "+", fontsize=18, va="center")
    a.add_patch(plt.Rectangle((side + 1.0, 0), wr, side, color=RANK_COLORS[1]))
    a.text(side + 1.0 + wr / 2, -0.25, f"B: {d} x {r}\n(init 0)", ha="center", va="top", fontsize=9)
    a.add_patch(plt.Rectangle((side + 1.4 + wr, side - wr), side, wr, color=RANK_COLORS[0]))
    a.text(side + 1.4 + wr + side / 2, side + 0.1, f"A: {r} x {k} (init Gaussian)", ha="center", va="bottom",
           fontsize=9)
    frozen, trained = d * k, r * (d + k)
    a.text(side + 1.4 + wr, side / 2 - 0.6, f"trainable r(d+k) = {trained:,}\n= {trained / frozen:.2%} of "
           f"d·k = {frozen:,}", fontsize=10, va="center")
    a.set_xlim(-0.2, 2 * side + 2.2)
    a.set_ylim(-1.0, side + 0.6)
    a.set_aspect("equal")
    a.axis("off")
    a.set_title(f"LoRA on one {d} x {k} projection, rank r = {r} (B and A drawn 8x wider)", fontsize=10)
    fig.tight_layout()
    return fig
