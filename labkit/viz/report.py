"""Tables and figures for notebooks 02 and 03: levers side by side, and scaling efficiency.

Pure functions of `RunRecord`s (plus matplotlib for the figures), so the notebooks stay thin.
Introduced in notebooks 02_single_gpu and 03_ddp.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from labkit.results import RunRecord
from labkit.train import metrics

#: NVIDIA Deep Learning Examples, ResNet-50 v1.5 training on DGX A100 (80 GB), PyTorch: 1 GPU with AMP
#: 2470 img/s, with TF32 938 img/s; 8 GPUs with AMP train 6.72x faster than 1 GPU. The 8-GPU point
#: keeps the batch PER GPU fixed (256 images), so the global batch grows 8x: weak scaling, although
#: NVIDIA's table heads the column "Strong Scaling".
NVIDIA_RESNET50_A100 = {"amp_1gpu_img_s": 2470.0, "tf32_1gpu_img_s": 938.0, "amp_8gpu_speedup": 6.72,
                        "per_gpu_batch": 256}
NVIDIA_RESNET50_SCALING = "weak"

#: What each kind of scaling keeps fixed as ranks are added.
SCALING_KINDS = {"strong": "fixed global batch", "weak": "fixed batch per rank", "mixed": "batch varies"}


def lever_rows(runs: Mapping[str, RunRecord]) -> list[dict]:
    """One row per labelled run: throughput, step time, epoch projection, peak memory, final loss."""
    rows = []
    for label, r in runs.items():
        rows.append({"run": label, "samples_per_s": round(r.samples_per_s, 1),
                     "step_ms": round(r.step_time_s * 1e3, 1), "epoch_min": round(r.train.epoch_time_s / 60, 2),
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


def scaling_kind(runs: Sequence[RunRecord]) -> str:
    """'strong' if every run trains the same global batch, 'weak' if every run keeps the same batch per
    rank (the global batch grows with the ranks), else 'mixed'. Speedups of the two kinds are not
    comparable: weak scaling hides the per-rank work shrinking that strong scaling exposes."""
    if len({r.global_batch for r in runs}) <= 1:
        return "strong"
    return "weak" if len({r.global_batch // r.world_size for r in runs}) == 1 else "mixed"


def scaling_rows(runs: Sequence[RunRecord]) -> list[dict]:
    """Per world size against the 1-rank run: wall-clock speedup and efficiency (speedup / ranks), the
    median step in ms, and from the ranks' CPU times `cpu_ms` (CPU-ms of a step, all ranks summed) and
    `cpu_share` (the least-served rank's CPU time / wall time: below ~0.8 other processes took its core)."""
    base = min(runs, key=lambda r: r.world_size)
    kind = scaling_kind(runs)
    rows = []
    for r in sorted(runs, key=lambda r: r.world_size):
        cpu, share = (r.train.cpu_step_time_s if r.train else []), metrics.cpu_share(r)
        rows.append({"ranks": r.world_size, "strategy": r.strategy, "samples_per_s": round(r.samples_per_s, 1),
                     "per_rank_batch": r.global_batch // r.world_size, "scaling": kind,
                     "step_ms": round(r.step_time_s * 1e3, 1), "cpu_ms": round(sum(cpu) * 1e3, 1) if cpu else None,
                     "cpu_share": round(min(share), 2) if share else None,
                     "speedup": round(r.samples_per_s / base.samples_per_s, 3),
                     "efficiency": round(metrics.wall_efficiency(base, r), 3)})
    return rows


def scaling_notes(runs: Sequence[RunRecord]) -> list[str]:
    """What the scaling table cannot say by itself, one line each: an efficiency above 1 flagged with
    its likely cause (from the CPU times: contention or cache), and ranks that did not have a core."""
    base = min(runs, key=lambda r: r.world_size)
    notes = []
    for r in sorted(runs, key=lambda r: r.world_size):
        share = metrics.cpu_share(r)
        if share and min(share) < 0.8:
            who = "the rank" if r.world_size == 1 else "a rank"
            notes.append(f"{r.world_size} rank(s): {who} computed only {min(share):.0%} of its wall-clock time -- "
                         f"other processes shared the CPU, and the wall clock measured them too; cpu_ms (CPU "
                         f"time) counts only what the ranks computed")
        if r is base:
            continue
        eff = metrics.wall_efficiency(base, r)
        if eff > metrics.EFFICIENCY_ARTEFACT:
            notes.append(f"{r.world_size} ranks: efficiency {eff:.2f} > 1 is no faster-than-ideal DDP but an artefact: "
                         + _artefact_cause(base, r))
    return notes


def _artefact_cause(base: RunRecord, r: RunRecord) -> str:
    b_share, r_share = metrics.cpu_share(base), metrics.cpu_share(r)
    if b_share and r_share and min(b_share) < 0.85 * min(r_share):
        return (f"CPU contention -- the 1-rank run computed {min(b_share):.0%} of its time, the {r.world_size} ranks "
                f"{min(r_share):.0%}: other processes slowed the baseline more than the ranks")
    b_cpu, r_cpu = metrics.cpu_seconds_per_sample(base), metrics.cpu_seconds_per_sample(r)
    if b_cpu and r_cpu and r_cpu < b_cpu:
        return (f"cache effects -- a sample cost {r_cpu * 1e3:.2f} CPU-ms on {r.world_size} ranks vs {b_cpu * 1e3:.2f} "
                f"on 1: the smaller per-rank batch ran faster per sample")
    return ("the 1-rank run was slowed by something the ranks were not (another process, a colder start); "
            "measure again on an idle machine")


def scaling_labels(runs: Sequence[RunRecord],
                   reference: Mapping[str, float] = NVIDIA_RESNET50_A100) -> tuple[str, str]:
    """Legend texts of `scaling_chart`: (this run's line, NVIDIA's point), each naming its kind of scaling."""
    kind = scaling_kind(runs)
    mine = f"measured: {kind} scaling ({SCALING_KINDS[kind]})"
    per_gpu = reference.get("per_gpu_batch", 256)
    theirs = (f"NVIDIA ResNet-50 A100 AMP: {NVIDIA_RESNET50_SCALING} scaling ({per_gpu:.0f} img per GPU), "
              f"{reference['amp_8gpu_speedup'] / 8:.0%} at 8 GPUs")
    return mine, theirs


def scaling_chart(runs: Sequence[RunRecord], *, reference: Mapping[str, float] = NVIDIA_RESNET50_A100):
    """Figure: measured speedup vs ranks, the ideal line, and NVIDIA's published A100 ResNet-50 point."""
    import matplotlib.pyplot as plt

    rows = scaling_rows(runs)
    ranks = [row["ranks"] for row in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    top = max(8, *ranks)
    ax.plot([1, top], [1, top], "--", color="gray", label="ideal (efficiency 1)")
    mine, theirs = scaling_labels(runs, reference)
    ax.plot(ranks, [row["speedup"] for row in rows], "o-", label=mine)
    odd = [row for row in rows if row["efficiency"] > metrics.EFFICIENCY_ARTEFACT]
    if odd:  # above the ideal line: a measurement artefact, flagged on the figure itself
        ax.plot([row["ranks"] for row in odd], [row["speedup"] for row in odd], "x", color="tab:red", ms=12,
                mew=2.5, label="above ideal: an artefact (CPU contention or cache), see the notes")
    ax.plot([1, 8], [1, reference["amp_8gpu_speedup"]], "s:", color="tab:green", label=theirs)
    ax.set(xlabel="ranks", ylabel="speedup over 1 rank", title="DDP scaling (compare like with like: strong vs weak)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
