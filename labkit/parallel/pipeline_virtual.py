"""Pipeline schedules with several stages per rank: interleaved 1F1B and zero bubble (ZB-V).

Both cut the model into v = 2 p virtual stages for p ranks (two model chunks per rank):

- Interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2.2; `ScheduleInterleaved1F1B`): rank r holds
  stages r and r + p (a loop). Each micro-batch visits every rank twice with half the work per visit,
  so the warm-up and cool-down shrink by v / p = 2: bubble (p - 1) / v of the ideal time, i.e. a
  share ((p-1)/2) / (m + (p-1)/2) -- at the price of twice the point-to-point messages.
- Zero bubble ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 6;
  `ScheduleZBVZeroBubble`): rank r holds stages r and 2p - 1 - r (a V, so the first and the last
  stage are on rank 0), and the backward is split into B (gradient w.r.t. the stage's input, which
  the previous stage waits for) and W (gradient w.r.t. its weights, which nobody waits for). W fills
  the slots where 1F1B idles; the bubble is ~0 when F, B and W take equal time.

Both run on CPU with gloo (torch 2.14, measured: losses equal to `single`). tiny-llama has only 2
decoder layers, so its 4 virtual stages are embedding | layer 0 | layer 1 | norm + LM head
(`split_virtual`). Registered as `pipeline-interleaved` and `pipeline-zero-bubble`; everything else
(data, loss, checkpoints, the measured schedule) is `labkit.parallel.pipeline`'s.
Introduced in notebook 09_beyond_3d.
"""
from __future__ import annotations

import contextlib

from torch import nn

from labkit.errors import ConfigError
from labkit.parallel import comm
from labkit.parallel.pipeline import LlamaStage, PipelineStrategy, split_layers
from labkit.parallel.pipeline_trace import ScheduleTrace, schedule_facts

#: strategy name -> (torch schedule class name, stage-to-rank style)
SCHEDULES = {"pipeline-interleaved": ("ScheduleInterleaved1F1B", "loop"),
             "pipeline-zero-bubble": ("ScheduleZBVZeroBubble", "v")}
CHUNKS = 2  # model chunks (virtual stages) per rank


def split_virtual(num_layers: int, stages: int) -> list[list[int]]:
    """Layer indices per virtual stage. With fewer layers than stages, the embedding and the LM head
    become stages of their own (first and last, no decoder layer)."""
    if stages <= num_layers:
        return split_layers(num_layers, stages)
    if stages - 2 < 1 or stages - 2 > num_layers:
        raise ConfigError(f"{stages} virtual pipeline stages for a model with {num_layers} layers: at most "
                          f"{num_layers + 2} (embedding and head as stages of their own); use fewer ranks")
    return [[]] + split_layers(num_layers, stages - 2) + [[]]


def local_stages(rank: int, ranks: int, style: str) -> list[int]:
    """The virtual stages rank `rank` holds: loop r, r + p; V r, 2p - 1 - r."""
    if style == "v":
        return [rank, 2 * ranks - 1 - rank]
    return [rank + i * ranks for i in range(CHUNKS)]


class LocalStages(nn.Module):
    """This rank's stage modules under the full model's parameter names (model.layers.<i>, lm_head...),
    so the optimizer, checkpoints and byte counts see one module."""

    def __init__(self, stages: list[LlamaStage]):
        super().__init__()
        self.config = stages[0].config
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict()
        for st in stages:
            if st.model.embed_tokens is not None:
                self.model.embed_tokens = st.model.embed_tokens
            self.model.layers.update(st.model.layers)
            if st.lm_head is not None:
                self.model.norm, self.lm_head = st.model.norm, st.lm_head


class MultiTrace:
    """One `ScheduleTrace` per local stage, merged per schedule run into (kind, mb, t0, t1, stage)
    events; 'W' marks a weight-gradient chunk of the zero-bubble schedules."""

    def __init__(self, pipe_stages, stage_ids):
        self.traces = [ScheduleTrace(s) for s in pipe_stages]
        self.stage_ids = stage_ids
        for trace, st in zip(self.traces, pipe_stages):  # B is then the input-gradient half only
            st.backward_weight_one_chunk = trace._timed("W", st.backward_weight_one_chunk)

    def begin_step(self) -> None:
        for t in self.traces:
            t.begin_step()

    def end_step(self) -> None:
        for t in self.traces:
            t.end_step()

    @property
    def steps(self) -> list[list[tuple]]:
        n = min(len(t.steps) for t in self.traces)
        return [sorted((e + (sid,) for t, sid in zip(self.traces, self.stage_ids) for e in t.steps[i]),
                       key=lambda e: e[2]) for i in range(n)]


def interleaved_bubble(stages: int, microbatches: int, chunks: int = CHUNKS) -> float:
    """Idle share of interleaved 1F1B: ((p-1)/v) / (m + (p-1)/v), Narayanan et al. 2021 Sec. 2.2.2."""
    return comm.bubble_fraction(stages, microbatches, chunks)


@contextlib.contextmanager
def _without_backward_module_hooks():
    """While the loop's CPU MemTracker watches a step (one warm-up step), stop its ModTracker from
    hooking module inputs/outputs for the backward: those multi-grad hooks fail under the zero-bubble
    split backward's `autograd.grad` on a stage's leaf input (torch 2.14: "A leaf node was passed to
    _will_engine_execute_node ..."). The tracker's device-wide peak does not need them. Patches a
    torch-internal name for that step only; on GPU the loop reads the CUDA allocator instead."""
    from torch.distributed._tools import mod_tracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if not any(isinstance(m, MemTracker) for m in _get_current_dispatch_mode_stack()):
        yield
        return
    original = mod_tracker.register_multi_grad_hook
    mod_tracker.register_multi_grad_hook = lambda *args, **kwargs: None
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = original


class VirtualPipelineStrategy(PipelineStrategy):
    """Hook for 'pipeline-interleaved' / 'pipeline-zero-bubble': two virtual stages per rank."""

    def __init__(self, name, ctx, cfg, task):
        super(PipelineStrategy, self).__init__(name, ctx, cfg, task)  # PipelineStrategy's, minus its schedule table
        self.schedule_name, self.style = SCHEDULES[name]
        from labkit.parallel.pipeline import microbatches_for
        self.microbatches = microbatches_for(cfg, ctx.world_size)
        self.pipe_stage = self.schedule = self.trace = None
        self.pipe_stages: list = []
        self.full_params = self.embed_params = 0
        self.gathered = []

    @classmethod
    def check(cls, cfg, world_size: int) -> None:
        from labkit.zoo.models import llm_config
        from labkit.parallel.pipeline import microbatches_for

        super().check(cfg, world_size)
        split_virtual(llm_config(cfg.run.model).num_hidden_layers, CHUNKS * world_size)
        m = microbatches_for(cfg, world_size)
        rounds = max(1, m // world_size)
        if m < world_size or m % rounds:
            raise ConfigError(f"{cfg.run.strategy} needs a number of micro-batches >= {world_size} stages and a "
                              f"multiple of m // stages; --microbatches {m} is not: use {2 * world_size}")

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed import pipelining

        from labkit.parallel.pipeline import pipeline_stage

        p, rank, v = self.ctx.world_size, self.ctx.rank, CHUNKS * self.ctx.world_size
        split = split_virtual(model.config.num_hidden_layers, v)
        ids = local_stages(rank, p, self.style)
        mods = [LlamaStage(model, split[s], first=s == 0, last=s == v - 1).to(self.ctx.device) for s in ids]
        self.pipe_stages = [pipeline_stage(m, s, v, self.ctx.device, self.ctx.group, example=self.example_micro_batch(),
                                           autocast=self.precision.autocast) for m, s in zip(mods, ids)]
        accum, mb = self.cfg.optim.accum, self.microbatches

        def loss_fn(logits, targets):  # (B/m, T, V) logits; mean over all m x accum micro-batches
            return self.task.criterion(logits, targets) / (mb * accum)

        cls = getattr(pipelining, self.schedule_name)
        self.schedule = cls(self.pipe_stages, mb, loss_fn=loss_fn, scale_grads=False)
        self.trace = MultiTrace(self.pipe_stages, ids)
        return LocalStages(mods)

    def train_step(self, micro_batches: list, loss_fn):
        split_backward = self.style == "v"  # B and W apart: autograd.grad on inputs, then on weights
        with _without_backward_module_hooks() if split_backward else contextlib.nullcontext():
            return super().train_step(micro_batches, loss_fn)

    def _run(self, inputs, targets, losses: list | None, *, train: bool):
        first = any(s.is_first for s in self.pipe_stages)
        last = any(s.is_last for s in self.pipe_stages)
        args, target = ((inputs,) if first else ()), (targets if last else None)
        with self.precision.autocast():
            return self.schedule.step(*args, target=target, losses=losses, return_outputs=False)

    def eval_logits(self, inputs, targets):
        """Forward only, stage after stage, whole batch (torch 2.14's runtime schedules cannot `eval`
        ZB-V: two adjacent stages on one rank hand over through the backward). The rank holding the
        last stage returns the (B, T, V) logits, the others None."""
        import torch
        import torch.distributed as dist

        v, ids = CHUNKS * self.ctx.world_size, [s.stage_index for s in self.pipe_stages]
        owner = {s: r for r in range(self.ctx.world_size) for s in local_stages(r, self.ctx.world_size, self.style)}
        shape = (*inputs.shape, self.model.config.hidden_size)  # (B, T, H) between stages
        h = None
        with torch.no_grad(), self.precision.autocast():
            for s in range(v):
                if owner[s] != self.ctx.rank:
                    continue
                if s == 0:
                    h = inputs
                elif owner[s - 1] != self.ctx.rank:
                    h = torch.empty(shape, device=self.ctx.device)
                    dist.recv(h, dist.get_global_rank(self.ctx.group, owner[s - 1]), group=self.ctx.group)
                h = self.pipe_stages[ids.index(s)].submod(h)
                if s < v - 1 and owner[s + 1] != self.ctx.rank:
                    dist.send(h.float().contiguous(), dist.get_global_rank(self.ctx.group, owner[s + 1]),
                              group=self.ctx.group)
        return h if owner[v - 1] == self.ctx.rank else None

    def record_facts(self) -> dict:
        from labkit.facts import PipelineFacts
        p, m = self.ctx.world_size, self.microbatches
        facts = schedule_facts(self.gathered, p, m, skip=2 * self.cfg.optim.accum)
        # Interleaved: Narayanan's formula; ZB-V: ~0 only when F, B and W take equal time (Qi et al. 2024).
        facts["bubble_theory"] = interleaved_bubble(p, m) if self.style == "loop" else 0.0
        return {"pipeline": PipelineFacts(
            pp=p, virtual_stages=CHUNKS * p, schedule=self.schedule_name, microbatches=m,
            stage_layers=split_virtual(self.model.config.num_hidden_layers, CHUNKS * p),
            local_stages=local_stages(0, p, self.style), **facts)}


STRATEGY_CLASSES = {name: VirtualPipelineStrategy for name in SCHEDULES}
