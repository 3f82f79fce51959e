"""Published large-scale training runs (`labkit/data/published_runs.json`) beside `labkit.parallel.perf_model`'s
prediction for the same layout: the planner's calibration table.

Every row cites its paper and table; `assumed` lists what the paper does not state, `calibration`
False marks a row shown for comparison but not yet checked against its source. Notebook 07 prints
`compare()`; tests/test_planner_calibration.py holds the model to within 20 % of every row.
Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources

from labkit.parallel import perf_model

DATA = "published_runs.json"


@dataclass(frozen=True)
class PublishedRun:
    """One row of the table (fields as in the JSON file)."""

    id: str
    source: str
    where: str
    hidden: int
    heads: int
    layers: int
    vocab: int
    seq: int
    gpu: str
    gpus: int
    tp: int
    pp: int
    dp: int
    batch: int
    micro_batch: int
    checkpointing: str
    reported: dict
    sequence_parallel: bool = False
    flash: bool = False
    zero: int = 0
    interleave: int = 1
    params_b: float | None = None
    assumed: tuple = ()
    calibration: bool = True
    note: str = ""

    @property
    def metric(self) -> str:
        """What the paper reports: 'mfu' when it gives one, else 'hfu' (recomputation counted)."""
        return "mfu" if "mfu" in self.reported else "hfu"

    def spec(self):
        from labkit.memory.params import gpt_spec

        cfg = dict(hidden_size=self.hidden, intermediate_size=4 * self.hidden, num_hidden_layers=self.layers,
                   num_attention_heads=self.heads, vocab_size=self.vocab, max_position_embeddings=self.seq)
        return gpt_spec(self.id, cfg)

    def layout(self) -> perf_model.Layout:
        return perf_model.Layout(dp=self.dp, tp=self.tp, pp=self.pp, micro_batch=self.micro_batch,
                                 microbatches=self.batch // (self.dp * self.micro_batch),
                                 checkpointing=self.checkpointing, zero=self.zero,
                                 sequence_parallel=self.sequence_parallel, interleave=self.interleave,
                                 flash=self.flash)

    def predict(self, efficiency: perf_model.Efficiency | None = None) -> perf_model.StepTime:
        eff = efficiency or perf_model.DEFAULT_EFFICIENCY[(perf_model.gpu_family(self.gpu), "bf16")]
        return perf_model.step_time(self.spec(), self.layout(), seq=self.seq, gpu=self.gpu, gpus_per_node=8,
                                    efficiency=eff)


@functools.lru_cache(maxsize=1)
def _load() -> dict:
    return json.loads(resources.files("labkit.data").joinpath(DATA).read_text())


def sources() -> dict:
    """Citation by source key."""
    return dict(_load()["sources"])


def runs(*, calibration_only: bool = False) -> list[PublishedRun]:
    rows = [PublishedRun(**{**r, "assumed": tuple(r.get("assumed", ()))}) for r in _load()["runs"]]
    return [r for r in rows if r.calibration or not calibration_only]


def best_mfu(gpu_family: str = "a100") -> float:
    """The highest MFU any calibrated row reports for this GPU family (the planner's ceiling)."""
    return max(r.reported["mfu"] for r in runs(calibration_only=True)
               if "mfu" in r.reported and perf_model.gpu_family(r.gpu) == gpu_family)


def compare(efficiency: perf_model.Efficiency | None = None) -> list[dict]:
    """One dict per run: layout, what the paper reports, what the model predicts, relative error."""
    out = []
    for r in runs():
        p = r.predict(efficiency)
        got = getattr(p, r.metric)
        want = r.reported[r.metric]
        out.append(dict(id=r.id, gpus=r.gpus, tp=r.tp, pp=r.pp, dp=r.dp, batch=r.batch,
                        checkpointing=r.checkpointing, metric=r.metric, reported=want, predicted=round(got, 3),
                        rel_err=round(got / want - 1, 3), mfu=round(p.mfu, 3), hfu=round(p.hfu, 3),
                        tflops_per_gpu=round(p.tflops_per_gpu, 1), calibration=r.calibration, source=r.source))
    return out


def format_compare(rows: list[dict]) -> str:
    head = (f"{'run':<34} {'GPUs':>5} {'t':>2} {'p':>3} {'d':>3} {'recompute':>9} {'metric':>6} "
            f"{'paper':>6} {'model':>6} {'error':>6}")
    lines = [head]
    for r in rows:
        mark = "" if r["calibration"] else "  (unverified row)"
        lines.append(f"{r['id']:<34} {r['gpus']:>5} {r['tp']:>2} {r['pp']:>3} {r['dp']:>3} {r['checkpointing']:>9} "
                     f"{r['metric']:>6} {r['reported']:>6.3f} {r['predicted']:>6.3f} {r['rel_err']:>+6.0%}{mark}")
    return "\n".join(lines)
