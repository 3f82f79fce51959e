"""Published large-scale training runs (`labkit/data/published_runs.json`) beside `labkit.parallel.perf_model`'s
prediction for the same layout: the planner's calibration AND held-out table.

Every row cites its source and quotes the numbers as read (`verified`); `assumed` lists what the source does
not state. `status` says whether the fitted constants (`labkit.parallel.hardware.CONSTANTS`) saw the row
(`calibration`) or not (`held_out`); `uncertain` quotes the source's own words where its layout or hardware
is too uncertain for the row to count. Errors are compared in tokens/s per GPU: a row that publishes a
utilization or TFLOPS is converted with the model's own FLOP count (the papers' formula: Narayanan et al.
2021 Eq. 3), so the ratio is the same either way. Notebook 07 prints `compare()`; `bench/planner_heldout.py`
prints the held-out table and a leave-one-source-out cross-validation (`labkit.parallel.calibration`).
Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from importlib import resources

from labkit.parallel import hardware, perf_model

DATA = "published_runs.json"
#: The reported metric a row is compared on, in order of preference (what the source published most directly).
METRICS = ("tokens_per_s_per_gpu", "iteration_s", "mfu", "hfu", "tflops_per_gpu")
LAYOUT_FIELDS = ("checkpointing", "zero", "sequence_parallel", "interleave", "flash", "fsdp", "shard_group",
                 "dp_overlap", "precision", "fused_kernels", "cp", "eager", "selective", "reduce_fp32", "tp_overlap",
                 "pipeline_engine", "pp_partition", "stack", "attention", "optimizer_states")

#: ZeRO stages the software of a source's runs offers, for the best-layout search (`search_rank`): NeMo 24.07 and
#: Megatron-Bridge 25.11 run Megatron-Core, whose distributed optimizer shards the optimizer states but keeps a
#: full-size gradient buffer (ZeRO-1: `--use-distributed-optimizer`) and whose sharded-everything mode is FSDP
#: (ZeRO-3: NeMo's torch FSDP, Megatron-FSDP); it has no ZeRO-2, so a recipe never chose against one. Sources not
#: listed: every stage.
ZERO_STAGES = {"nemo2024": (0, 1, 3), "bridge2025": (0, 1, 3)}


@dataclass(frozen=True)
class PublishedRun:
    """One row of the table (fields as in the JSON file)."""

    id: str
    source: str
    where: str
    status: str
    seq: int
    gpu: str
    gpus: int
    tp: int
    pp: int
    dp: int
    batch: int
    micro_batch: int
    reported: dict
    verified: str
    hidden: int = 0
    heads: int = 0
    layers: int = 0
    vocab: int = 0
    ffn: int = 0
    config: dict | None = None
    params_b: float | None = None
    gpus_per_node: int = 8
    inter_node_gbps: float | None = None
    layout_options: dict = field(default_factory=dict)
    assumed: tuple = ()
    uncertain: str = ""
    note: str = ""
    hardware: str = ""
    miss: str = ""
    """Why a counted row the model misses by more than 20 % is missed (printed by bench/planner_heldout.py)."""
    fused_loss: bool = False
    """The run's cross-entropy is a fused kernel (memory only: `labkit.memory.activations.Step.fused_loss`)."""

    @classmethod
    def from_dict(cls, row: dict) -> "PublishedRun":
        row = dict(row)
        opts = {k: row.pop(k) for k in LAYOUT_FIELDS if k in row}
        assumed = tuple(row.pop("assumed", ()))
        return cls(**row, layout_options=opts, assumed=assumed)

    @property
    def calibration(self) -> bool:
        return self.status == "calibration"

    @property
    def counts(self) -> bool:
        """Whether the row counts in the 20 % criterion (no `uncertain` statement)."""
        return not self.uncertain

    @property
    def metric(self) -> str:
        return next(m for m in METRICS if m in self.reported)

    def spec(self):
        from labkit.memory.params import gpt_spec

        if self.config:
            return _spec(self.id, json.dumps(self.config, sort_keys=True))
        cfg = dict(hidden_size=self.hidden, intermediate_size=self.ffn or 4 * self.hidden,
                   num_hidden_layers=self.layers, num_attention_heads=self.heads, vocab_size=self.vocab,
                   max_position_embeddings=self.seq)
        return gpt_spec(self.id, cfg)

    def layout(self) -> perf_model.Layout:
        opts = {"checkpointing": "full", "sequence_parallel": False, "flash": False, **self.layout_options}
        return perf_model.Layout(dp=self.dp, tp=self.tp, pp=self.pp, micro_batch=self.micro_batch,
                                 microbatches=self.batch // (self.dp * self.micro_batch), **opts)

    def predict(self, efficiency: hardware.Efficiency | None = None) -> perf_model.StepTime:
        lay = self.layout()
        eff = efficiency or hardware.default_efficiency(self.gpu, lay.precision)
        return perf_model.step_time(self.spec(), lay, seq=self.seq, gpu=self.gpu, gpus_per_node=self.gpus_per_node,
                                    efficiency=eff, inter_node_gbps=self.inter_node_gbps)

    def compare(self, efficiency: hardware.Efficiency | None = None) -> dict:
        """Predicted vs published tokens/s per GPU (and the source's own metric), and the relative error."""
        p = self.predict(efficiency)
        metric, want = self.metric, self.reported[self.metric]
        tps = p.tokens_per_s_per_gpu
        if metric == "tokens_per_s_per_gpu":
            published = want
        elif metric == "iteration_s":
            published = self.batch * self.seq / want / self.gpus
        else:  # a utilization or a FLOP rate: the model's FLOPs per token convert it
            published = tps * want / getattr(p, metric)
        return dict(id=self.id, source=self.source, status=self.status, counts=self.counts, gpus=self.gpus,
                    gpu=self.gpu, tp=self.tp, pp=self.pp, dp=self.dp, zero=self.layout().zero, metric=metric,
                    reported=want, predicted_tps=round(tps, 2), published_tps=round(published, 2),
                    rel_err=round(tps / published - 1, 4), mfu=round(p.mfu, 3), hfu=round(p.hfu, 3),
                    tflops_per_gpu=round(p.tflops_per_gpu, 1),
                    **({"published_tflops": self.reported["tflops_per_gpu"]} if "tflops_per_gpu" in self.reported
                       else {}))


@functools.lru_cache(maxsize=64)
def _spec(name: str, config: str):
    from labkit.memory.params import family_spec

    return family_spec(name, json.loads(config))


@functools.lru_cache(maxsize=1)
def _load() -> dict:
    return json.loads(resources.files("labkit.data").joinpath(DATA).read_text())


def sources() -> dict:
    """Citation by source key."""
    return dict(_load()["sources"])


def runs(*, calibration_only: bool = False, held_out_only: bool = False) -> list[PublishedRun]:
    rows = [PublishedRun.from_dict(r) for r in _load()["runs"]]
    if calibration_only:
        rows = [r for r in rows if r.calibration]
    if held_out_only:
        rows = [r for r in rows if not r.calibration]
    return rows


def compare(efficiency: hardware.Efficiency | None = None, rows=None) -> list[dict]:
    """One dict per run: layout, what the source reports, what the model predicts, relative error."""
    return [r.compare(efficiency) for r in (rows if rows is not None else runs())]


def format_compare(rows: list[dict]) -> str:
    head = (f"{'run':<38} {'status':<11} {'GPUs':>6} {'t':>2} {'p':>3} {'d':>4} {'z':>1} "
            f"{'tok/s/GPU':>9} {'model':>9} {'error':>6}")
    lines = [head]
    for r in rows:
        mark = "" if r["counts"] else "  (uncertain: not counted)"
        lines.append(f"{r['id']:<38} {r['status']:<11} {r['gpus']:>6} {r['tp']:>2} {r['pp']:>3} {r['dp']:>4} "
                     f"{r['zero']:>1} {r['published_tps']:>9.1f} {r['predicted_tps']:>9.1f} {r['rel_err']:>+6.0%}{mark}")
    return "\n".join(lines)



def memory(run: PublishedRun):
    """The estimator's per-GPU bytes for a row's layout (`labkit.memory.estimate`, the planner's settings:
    mixed-bf16 Adam, the row's recomputation, fused kernels unless the row says otherwise)."""
    from labkit.memory.estimate import MemoryConfig, estimate

    lay = run.layout()
    cfg = MemoryConfig(model=run.id, precision="mixed-bf16", zero=lay.zero, dp=run.dp, tp=run.tp, pp=run.pp,
                       cp=lay.cp, batch=run.batch // run.dp, grad_accum=lay.microbatches, seq=run.seq,
                       checkpointing=lay.checkpointing, flash_attention=lay.flash,
                       sequence_parallel=lay.sequence_parallel and run.tp > 1, fused_kernels=lay.fused_kernels,
                       optimizer_states=lay.optimizer_states, fused_loss=run.fused_loss)
    return estimate(cfg, spec=run.spec())


def hf_config(run: PublishedRun) -> dict:
    """The row's model as a Hugging Face config (what `labkit plan --model config.json` reads): its own `config`,
    or GPT-2 fields for a row given as hidden / heads / layers / vocab / ffn."""
    if run.config:
        return dict(run.config)
    return {"model_type": "gpt2", "n_embd": run.hidden, "n_layer": run.layers, "n_head": run.heads,
            "n_inner": run.ffn or 4 * run.hidden, "vocab_size": run.vocab, "n_positions": run.seq}


def search_rank(run: PublishedRun, folder, *, software: bool = True) -> dict:
    """Where the best-layout search puts the row's layout: `labkit plan` with the row's model, GPUs, batch,
    sequence and software (`folder` receives the model's config.json; `software`: only the ZeRO stages that
    software has, `ZERO_STAGES`; False: every stage). `rank` is the row's (dp, tp, pp, cp,
    ZeRO) among the layouts that fit, fastest first (its best micro-batch; None: not found among the fits, then
    `dropped` says why); `order` every fitting (dp, tp, pp, cp, zero) in that order; `top` the three fastest."""
    from pathlib import Path

    from labkit.parallel import planner

    lay = run.layout()
    path = Path(folder) / f"{run.id}.json"
    path.write_text(json.dumps(hf_config(run)))
    req = planner.PlanRequest(model=str(path), gpus=run.gpus, gpus_per_node=run.gpus_per_node, gpu=run.gpu,
                              batch=run.batch, seq=run.seq, checkpointing=lay.checkpointing,
                              interleave=lay.interleave, flash=lay.flash, sequence_parallel=lay.sequence_parallel,
                              precision=lay.precision, fsdp=lay.fsdp, fused_kernels=lay.fused_kernels,
                              stack=lay.stack, attention=lay.attention if lay.flash else "eager",
                              tp_overlap=lay.tp_overlap, optimizer_states=lay.optimizer_states,
                              inter_node_gbps=run.inter_node_gbps,
                              zero_stages=ZERO_STAGES.get(run.source, (0, 1, 2, 3)) if software else (0, 1, 2, 3))
    p = planner.plan(req)
    key = (run.dp, run.tp, run.pp, lay.cp, lay.zero)
    layouts = list(dict.fromkeys((o.dp, o.tp, o.pp, o.cp, o.zero) for o in p.fits))  # fastest micro-batch first
    mine = [o for o in p.fits + p.too_big if (o.dp, o.tp, o.pp, o.cp, o.zero) == key]
    return {"id": run.id, "rank": layouts.index(key) + 1 if key in layouts else None, "layouts": len(layouts),
            "order": layouts,
            "top": [o.layout + f" {o.tokens_per_s_per_gpu:.0f} tok/s/GPU"
                    for o in [next(o for o in p.fits if (o.dp, o.tp, o.pp, o.cp, o.zero) == k) for k in layouts[:3]]],
            "published": mine[0].layout + f" {mine[0].tokens_per_s_per_gpu:.0f} tok/s/GPU" if mine else None,
            "dropped": (mine[0].overflow if mine and not mine[0].fits else
                        next((r for d, t, pp, r in p.rejected if (d, t, pp) == key[:3]), "") if not mine else "")}


#: Sources whose rows are tuned recipes (the vendor swept layouts and published the fastest).
RECIPES = ("nemo2024", "bridge2025")
#: Layouts a source ran head to head on the same model, GPUs and batch: (the published best, the others).
COMPARED = {"megatron-t2-175b-384": ("zero3-175b-384",), "megatron-t2-175b-768": ("zero3-175b-768",),
            "megatron-t2-175b-1536": ("zero3-175b-1536",)}


def search_verdicts(rows, folder, *, software: bool = True) -> list[dict]:
    """Issue 42's search criterion, row by row: a recipe's layout (`RECIPES`) within the search's top 3, a
    compared layout (`COMPARED`) ranked above every layout it was compared with. Each `search_rank`'s dict plus
    `ok` and `compared` ({id: rank}); `software` as in `search_rank`."""
    by_id = {r.id: r for r in rows}
    out = []
    for r in [r for r in rows if r.source in RECIPES] + [by_id[k] for k in COMPARED if k in by_id]:
        s = search_rank(r, folder, software=software)
        compared = {}
        for other in COMPARED.get(r.id, ()):  # its layout in the same search (same model, GPUs, batch)
            o = by_id[other]
            key = (o.dp, o.tp, o.pp, o.layout().cp, o.layout().zero)
            compared[other] = s["order"].index(key) + 1 if key in s["order"] else None
        ok = s["rank"] is not None and (all(c is None or s["rank"] < c for c in compared.values()) if compared
                                        else s["rank"] <= 3)
        out.append({**s, "ok": ok, "compared": compared})
    return out

