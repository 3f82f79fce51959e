"""Pipeline parallelism: the LLM split by layers into stages, micro-batches flowing through them.

Each rank keeps one stage (stage 0: embedding + its layers; the last: its layers + norm + LM head),
so parameter bytes per rank are ~1/p. A step cuts the batch into m micro-batches; stage s runs F(i)
after receiving stage s-1's activations and B(i) after receiving stage s+1's gradients
(`torch.distributed.pipelining`, point-to-point send/recv between neighbours).

- GPipe (Huang et al. 2019): all m forwards, then all m backwards. Stage s holds m micro-batches of
  activations at the peak.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021, Sec. 2.2): after p - s warm-up forwards every stage
  alternates one forward and one backward, so at most p - s micro-batches are in flight.

Both idle the same share of each stage -- the bubble: (p - 1) / (m + p - 1) of the step with
equal-cost stages (Narayanan et al. 2021, Sec. 2.2.1, write it as (p - 1) / m of the ideal time).
1F1B buys memory, not a smaller bubble; more micro-batches (or interleaved stages) shrink it. We
measure it: every stage records when it ran which micro-batch (`ScheduleTrace`), and bubble =
1 - busy / span over the step, averaged over the stages (`labkit.parallel.comm`, the schedule model);
`labkit.viz.pipeline_schedule` draws the schedule diagram.
Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

import torch
from torch import nn

from labkit.errors import ConfigError
from labkit.parallel.comm import bubble_fraction  # noqa: F401  (re-exported: notebooks read P.bubble_fraction)
from labkit.parallel.pipeline_trace import ScheduleTrace, schedule_facts
from labkit.parallel.single import Strategy


def apply_pipeline(model: nn.Module, group, *, cfg=None, stage: int | None = None,
                   num_stages: int | None = None) -> LlamaStage:
    """This rank's stage of `model` (an HF Llama causal LM): stage = rank in `group` unless given.

    The rest of the model is dropped (to be freed); the stage stays on the model's device.
    """
    import torch.distributed as dist

    if stage is None or num_stages is None:
        stage, num_stages = dist.get_rank(group), dist.get_world_size(group)
    if getattr(model.config, "tie_word_embeddings", False) and num_stages > 1:
        raise ConfigError("this model ties its LM head to the embedding, which pipeline stages 0 and "
                          f"{num_stages - 1} would both need; use an untied preset (tiny-llama, llama2-7b) "
                          "or --strategy tensor")
    # Stage s keeps layers split_layers(L, p)[s] (~L/p of them): (B, T) ids -> stage 0 -> (B, T, H) -> ...
    # -> last stage -> (B, T, V) logits; only activations of one micro-batch cross each boundary.
    layers = split_layers(model.config.num_hidden_layers, num_stages)[stage]
    return LlamaStage(model, layers, first=stage == 0, last=stage == num_stages - 1)


SCHEDULES = {"pipeline-gpipe": "gpipe", "pipeline-1f1b": "1f1b"}


def split_layers(num_layers: int, stages: int) -> list[list[int]]:
    """Layer indices per stage, as even as possible (earlier stages take the remainder)."""
    if stages > num_layers:
        raise ConfigError(f"{stages} pipeline stages for a model with {num_layers} layers: every stage needs "
                          f"at least one layer; use --nproc {num_layers} or fewer")
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


class LlamaStage(nn.Module):
    """Layers of one pipeline stage of an HF Llama causal LM, keeping the full model's parameter names
    (`model.layers.<i>...`) so state dicts of stages line up with the single model's.

    forward: stage 0 takes token ids (B, T); others hidden states (B, T, H); the last returns logits
    (B, T, V), the others hidden states (B, T, H).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], *, first: bool, last: bool):
        super().__init__()
        self.config = model.config
        self.model = nn.Module()
        self.model.embed_tokens = model.model.embed_tokens if first else None
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layer_ids})
        self.model.norm = model.model.norm if last else None
        self.model.rotary_emb = model.model.rotary_emb  # cos/sin tables: buffers, no parameters
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x  # (B, T, H)
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)  # (1, T)
        rope = self.model.rotary_emb(h, position_ids=pos)  # (cos, sin), each (1, T, head_dim)
        # (config, inputs_embeds, attention_mask, cache, position_ids) by position: transformers 5.x renamed
        # `past_key_values` to `cache` (the old name goes in 5.40); no KV cache in training. None: SDPA's is_causal.
        mask = create_causal_mask(self.config, h, None, None, pos)
        for layer in self.model.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=pos)
        if self.lm_head is not None:
            h = self.lm_head(self.model.norm(h))  # (B, T, V)
        return h


def build_schedule(stage_module: nn.Module, group, *, schedule: str, microbatches: int, loss_fn,
                   device: torch.device, example: tuple[int, int] | None = None, autocast=None):
    """A `PipelineStage` around `stage_module` and its GPipe / 1F1B schedule (scale_grads=False:
    `loss_fn` itself divides by the number of micro-batches, so gradient accumulation stays exact).
    `example` (micro-batch, tokens) and `autocast`: see `pipeline_stage`."""
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if schedule not in classes:
        raise ConfigError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(classes)}")
    pipe_stage = pipeline_stage(stage_module, dist.get_rank(group), dist.get_world_size(group), device, group,
                                example=example, autocast=autocast)
    return pipe_stage, classes[schedule](pipe_stage, microbatches, loss_fn=loss_fn, scale_grads=False)


def pipeline_stage(module: nn.Module, index: int, stages: int, device, group, *, example=None, autocast=None):
    """`PipelineStage(module, index, stages, device, group=group)`. Stages normally learn each other's
    activation shapes by exchanging them at the first step; torch's fake process group (a rehearsal,
    labkit.runtime.rehearsal) exchanges nothing, so there the stage gets its static metadata instead: the input
    and output of a local forward of one zero micro-batch of shape `example` = (micro-batch, tokens),
    under the run's `autocast` (the output's dtype), and gradients of their shapes."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    static = {}
    if example is not None and dist.get_backend(group) == "fake":
        mb, tokens = example
        first = getattr(module.model, "embed_tokens", None) is not None
        x = torch.zeros(mb, tokens, dtype=torch.long, device=device) if first else \
            torch.zeros(mb, tokens, module.config.hidden_size, device=device)
        with torch.no_grad(), (autocast() if autocast else contextlib.nullcontext()):
            y = module(x)
        static = dict(input_args=(x,), output_args=(y,), output_grads=(torch.zeros_like(y),),
                      input_grads=(None if first else torch.zeros_like(x),))
    return PipelineStage(module, index, stages, device, group=group, **static)


# ------------------------------------------------------------------------------------------ hook
def microbatches_for(cfg, stages: int) -> int:
    """--microbatches M, or by default 2 x stages (bubble (p-1)/(3p-1): 1/5 on 2 stages)."""
    return getattr(getattr(cfg, "optim", None), "microbatches", None) or 2 * stages


def _flat():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(flatten_optimizer_state_dict=True)


class PipelineStrategy(Strategy):
    """Hook for 'pipeline-gpipe' / 'pipeline-1f1b': every rank is one stage, no data parallelism.

    Every rank reads the whole batch (dp_size 1); stage 0 feeds the inputs, the last stage the targets
    and returns the loss (None elsewhere, which the loop expects). Gradients need no all-reduce: each
    parameter lives on one stage only.
    """

    def __init__(self, name, ctx, cfg, task):
        super().__init__(name, ctx, cfg, task)  # dims: pp = world, so dp_rank 0, dp_size 1
        self.schedule_name = SCHEDULES[name]
        self.microbatches = microbatches_for(cfg, ctx.world_size)
        self.pipe_stage = self.schedule = self.trace = None
        self.full_params = self.embed_params = 0
        self.gathered: list[list[list[tuple]]] = []

    @classmethod
    def check(cls, cfg, world_size: int) -> None:
        from labkit.zoo.models import llm_config

        if cfg.kind != "llm":
            raise ConfigError(f"strategy {cfg.run.strategy!r} splits a transformer by layers; {cfg.run.model!r} is not "
                              "an LLM: use --model tiny-llama (or a Llama preset / checkpoint)")
        if cfg.precision.amp == "fp16":
            raise ConfigError("pipeline strategies run --amp bf16 or none: fp16 loss scaling would need its "
                              "overflow check agreed across stages; use --amp bf16")
        split_layers(llm_config(cfg.run.model).num_hidden_layers, world_size)
        m = microbatches_for(cfg, world_size)
        if cfg.run.strategy == "pipeline-1f1b" and m < world_size:
            raise ConfigError(f"1F1B needs at least as many micro-batches as stages: --microbatches {m} < "
                              f"{world_size} stages; use --microbatches {world_size} or more")
        if cfg.optim.batch % (m * cfg.optim.accum):
            raise ConfigError(f"global batch {cfg.optim.batch} does not split into {cfg.optim.accum} x {m} pipeline "
                              f"micro-batches; choose --batch as a multiple of {m * cfg.optim.accum}")
        super().check(cfg, world_size)

    def build_model(self) -> nn.Module:
        # Built on the host; only this rank's stage moves to the device in `wrap`.
        from labkit.zoo.models import build_model
        model = build_model(self.cfg.run.model, seed=self.cfg.run.seed)
        self.full_params = sum(p.numel() for p in model.parameters())
        self.embed_params = model.get_input_embeddings().weight.numel()
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        stage = apply_pipeline(model, self.ctx.group, cfg=self.cfg).to(self.ctx.device)
        accum, m = self.cfg.optim.accum, self.microbatches

        def loss_fn(logits, targets):  # (B/m, T, V) logits; mean over all m x accum micro-batches
            return self.task.criterion(logits, targets) / (m * accum)

        self.pipe_stage, self.schedule = build_schedule(stage, self.ctx.group, schedule=self.schedule_name,
                                                        microbatches=m, loss_fn=loss_fn, device=self.ctx.device,
                                                        example=self.example_micro_batch(),
                                                        autocast=self.precision.autocast)
        self.trace = ScheduleTrace(self.pipe_stage)
        return stage

    def example_micro_batch(self) -> tuple[int, int]:
        """(samples, tokens) of one pipeline micro-batch."""
        return self.cfg.optim.batch // (self.microbatches * self.cfg.optim.accum), self.cfg.run.seq_len

    def _run(self, inputs, targets, losses: list | None, *, train: bool):
        args = (inputs,) if self.pipe_stage.is_first else ()
        target = targets if self.pipe_stage.is_last else None
        with self.precision.autocast():
            if train:
                return self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
            return self.schedule.eval(*args, target=target, losses=losses)

    def train_step(self, micro_batches: list, loss_fn):
        self.optimizer.zero_grad(set_to_none=True)
        total = None  # the schedule drives the forward; the loop's `loss_fn` (model -> loss) does not apply
        for inputs, targets in micro_batches:  # --accum chunks, each cut into m pipeline micro-batches
            losses: list = []
            self.trace.begin_step()
            self._run(inputs, targets, losses, train=True)
            self.trace.end_step()
            if losses:
                part = torch.stack([x.detach() for x in losses]).sum()
                total = part if total is None else total + part
        self.optimizer_step()
        return total

    def eval_logits(self, inputs, targets):
        # The schedule runs every stage; only the last one gets the merged (B, T, V) logits.
        return self._run(inputs, targets, None, train=False)

    def state_dict(self) -> dict:
        # Stages hold different parameters: flatten the optimizer's param_groups per parameter FQN
        # (torchtitan does the same), else DCP merges every stage's group 0 into one entry.
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_flat())
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=_flat())

    def resident_bytes(self):
        # Every rank calls this once at the end of the run: the one point where all stages can
        # exchange their schedule traces (record_facts runs on rank 0 alone).
        import torch.distributed as dist
        self.gathered = [None] * self.ctx.world_size
        dist.all_gather_object(self.gathered, self.trace.steps, group=self.ctx.group)
        return super().resident_bytes()

    def trainable_params(self) -> int:
        return self.full_params  # the whole model's, as for the other strategies

    def flops_per_step(self, global_tokens: int) -> float | None:
        return 6.0 * (self.full_params - self.embed_params) * global_tokens

    def record_facts(self) -> dict:
        from labkit.facts import PipelineFacts
        return {"pipeline": PipelineFacts(
            pp=self.ctx.world_size, schedule=self.schedule_name, microbatches=self.microbatches,
            stage_layers=split_layers(self.model.config.num_hidden_layers, self.ctx.world_size),
            **schedule_facts(self.gathered, self.ctx.world_size, self.microbatches, skip=2 * self.cfg.optim.accum))}

STRATEGY_CLASSES = {name: PipelineStrategy for name in SCHEDULES}
