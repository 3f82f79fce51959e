"""The single-process strategy, which is also the base `Strategy` hook every strategy refines.

Read the contract in `labkit/parallel/__init__.py` first. Each method here is the plain
one-device behaviour; `ddp.py` shows how little a data-parallel strategy has to change.
Introduced in notebook 02_single_gpu.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from labkit.runtime import device as devices
from labkit.errors import ConfigError
from labkit.parallel.dims import ParallelDims
from labkit.train import levers
from labkit.train.metrics import ResidentBytes, resident_bytes


@dataclass(frozen=True)
class DistContext:
    """Who this process is. `group` is the world process group (None in a single process)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def apply_single(model: nn.Module, group=None, *, cfg=None) -> nn.Module:
    """Nothing to distribute: the model as is (the contract's `apply_<x>` for 'single')."""
    return model


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every single-process save/load although we ask for exactly that (no_dist=True)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class Strategy:
    """Default hook = one process training the whole model. See the table in labkit.parallel."""

    #: False for strategies that run in the notebook's own process (no torchrun needed).
    needs_process_group = True
    #: Upper bound on ranks (1 for 'single'), None for any.
    max_world_size: int | None = None
    example_model: str | None = None
    """A model this strategy needs instead of the profile's LLM when trained as an example (preflight)."""

    def __init__(self, name: str, ctx: DistContext, cfg, task):
        self.name, self.ctx, self.cfg, self.task = name, ctx, cfg, task
        self.dims = self.dims_for(cfg, ctx.world_size, name)
        self.dp_rank, self.dp_size = self.dims.dp_rank(ctx.rank), self.dims.dp_size
        self.precision = levers.Precision(cfg.precision.amp, ctx.device)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    # ------------------------------------------------------------------ validation (before launch)
    @classmethod
    def check(cls, cfg, world_size: int) -> None:
        """Raise ConfigError for settings this strategy cannot run; `cfg` is resolved."""
        if cls.max_world_size is not None and world_size > cls.max_world_size:
            raise ConfigError(f"strategy {cfg.run.strategy!r} runs {cls.max_world_size} process(es), not {world_size}; "
                              "use --nproc 1 or a data-parallel strategy such as --strategy ddp")
        dp = cls.dp_size_for(cfg, world_size)
        if cfg.optim.batch % (dp * cfg.optim.accum):
            raise ConfigError(f"global batch {cfg.optim.batch} does not split into {dp} data-parallel rank(s) x "
                              f"{cfg.optim.accum} micro-batch(es); choose --batch as a multiple of {dp * cfg.optim.accum}")

    @classmethod
    def launch_env(cls, cfg) -> dict[str, str]:
        """Extra environment for the launched ranks (e.g. DS_ACCELERATOR=cpu for DeepSpeed on CPU)."""
        return {}

    @classmethod
    def dims_for(cls, cfg, world_size: int, name: str | None = None) -> ParallelDims:
        """The run's topology: the ParallelDims preset of the strategy's registry name (labkit.parallel.dims)."""
        return ParallelDims.for_config(cfg, world_size, name)

    @classmethod
    def dp_size_for(cls, cfg, world_size: int) -> int:
        """Data-parallel degree for `world_size` ranks: ranks that read different samples."""
        return cls.dims_for(cfg, world_size).dp_size

    # ------------------------------------------------------------------ build
    def setup(self) -> None:
        """Build, parallelize and make the optimizer; sets `self.model`, `self.optimizer`."""
        model = self.build_model()
        self.model = self.parallelize(model)
        self.optimizer = self.build_optimizer(self.model)

    def build_model(self) -> nn.Module:
        from labkit.zoo.models import build_model
        return devices.place(build_model(self.cfg.run.model, seed=self.cfg.run.seed), self.ctx.device)

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Levers in a fixed order: memory format and activation checkpointing change the single-device
        model, `wrap` distributes it, compile goes last (over DDP, dynamo splits graphs at bucket borders)."""
        if self.cfg.precision.channels_last:
            model = levers.apply_channels_last(model)
        if self.cfg.memory.checkpointing:
            model = levers.apply_activation_checkpointing(model)
        model = self.wrap(model)
        return levers.apply_compile(model) if self.cfg.precision.compile else model

    def wrap(self, model: nn.Module) -> nn.Module:
        return apply_single(model, self.ctx.group, cfg=self.cfg)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """`--optimizer` (labkit.optim) over the trainable parameters. The default AdamW (Loshchilov &
        Hutter 2019) keeps two fp32 moments: 8 bytes per trainable parameter; adamw-8bit 2 (06_peft)."""
        from labkit.optim import build_optimizer
        params = [p for p in model.parameters() if p.requires_grad]
        return build_optimizer(self.cfg.optim.optimizer or "adamw", params, self.cfg.optim.lr)

    # ------------------------------------------------------------------ one optimizer step
    def no_sync(self):
        """Context for micro-batches whose gradients must not be communicated yet."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    def optimizer_step(self) -> None:
        self.precision.step(self.optimizer)

    def train_step(self, micro_batches: list, loss_fn: Callable) -> torch.Tensor | None:
        """One optimizer step over this rank's micro-batches; returns the local mean loss (detached).

        Each micro-batch loss is divided by their count, so the accumulated gradient is the mean over
        the rank's share of the global batch. Gradients are zeroed at the START of the step, so they
        stay resident afterwards for `resident_bytes()`.
        """
        self.optimizer.zero_grad(set_to_none=True)
        total, last = None, len(micro_batches) - 1
        for i, (inputs, targets) in enumerate(micro_batches):
            with self.no_sync() if i < last else contextlib.nullcontext():
                with self.precision.autocast():
                    loss = loss_fn(self.model, inputs, targets) / len(micro_batches)
                self.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
        self.optimizer_step()
        return total

    # ------------------------------------------------------------------ evaluation
    def eval_logits(self, inputs, targets):
        """Full logits of one held-out batch on this rank ((B, T, V) or (B, classes)); None on a rank
        that produces none (a pipeline stage other than the last)."""
        with self.precision.autocast():
            return self.task.logits(self.model, inputs)

    @torch.no_grad()
    def evaluate(self, batches: list) -> dict | None:
        """{'loss_sum', 'correct', 'count'} over held-out (inputs, targets) batches on this rank;
        None when this rank saw no logits."""
        self.model.eval()
        loss_sum, correct, count = 0.0, 0, 0
        try:
            for inputs, targets in batches:
                logits = self.eval_logits(inputs, targets)
                if logits is None:
                    continue
                n = targets.numel()
                loss_sum += float(self.task.criterion(logits, targets)) * n
                correct += int((logits.argmax(-1) == targets).sum())
                count += n
        finally:
            self.model.train()
        return {"loss_sum": loss_sum, "correct": correct, "count": count} if count else None

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """DCP-ready state: FQN-keyed model and optimizer (no 'module.' prefix, DTensors kept sharded)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def save_checkpoint(self, path: Path) -> None:
        """Write this rank's part of the checkpoint into folder `path` (collective over ctx.group)."""
        import torch.distributed.checkpoint as dcp
        with _quiet_single_process():
            dcp.save(self.state_dict(), checkpoint_id=str(path), process_group=self.ctx.group,
                     no_dist=self.ctx.group is None)
        self._save_rank_state(path)

    def load_checkpoint(self, path: Path) -> None:
        """Load folder `path` into the built model and optimizer (any world size: DCP reshards)."""
        import torch.distributed.checkpoint as dcp
        state = self.state_dict()  # the template DCP loads into, in place
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(path), process_group=self.ctx.group, no_dist=self.ctx.group is None)
        self.load_state_dict(state)
        self._load_rank_state(path)

    def _save_rank_state(self, path: Path) -> None:
        # Per-rank RNG and loss-scaler state: small, not sharded, one file per rank.
        state = {"cpu_rng": torch.get_rng_state(), "scaler": self.precision.state_dict()}
        if devices.is_gpu(self.ctx.device):
            state["cuda_rng"] = devices.rng_state(self.ctx.device)
        torch.save(state, Path(path) / f"rank_state_{self.ctx.rank}.pt")

    def _load_rank_state(self, path: Path) -> None:
        file = Path(path) / f"rank_state_{self.ctx.rank}.pt"
        if not file.is_file():  # resumed on more ranks than saved: fresh RNG for the new ones
            return
        state = torch.load(file, weights_only=False)
        torch.set_rng_state(state["cpu_rng"])
        if "cuda_rng" in state and devices.is_gpu(self.ctx.device):
            devices.set_rng_state(state["cuda_rng"], self.ctx.device)
        self.precision.load_state_dict(state.get("scaler", {}))

    # ------------------------------------------------------------------ accounting
    def resident_bytes(self) -> ResidentBytes:
        return resident_bytes(self.model, self.optimizer, self.ctx.device)

    def trainable_params(self) -> int:
        seen = {id(p): p.numel() for p in self.model.parameters() if p.requires_grad}
        return sum(seen.values())

    def flops_per_step(self, global_tokens: int) -> float | None:
        """Analytic FLOPs of one global step, or None to have the loop measure them.

        LLMs: 6 * N * tokens (Kaplan et al. 2020: 2N forward + 4N backward per token), N without the
        input embedding table (a lookup, not a matmul). Vision: measured with FlopCounterMode.
        """
        if self.task.kind != "llm":
            return None
        model = self._unwrapped()
        weights = {id(p): p.numel() for p in model.parameters()}  # DTensor numel is the global size
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        embed_n = embed.weight.numel() if embed is not None else 0
        return 6.0 * (sum(weights.values()) - embed_n) * global_tokens

    def _unwrapped(self) -> nn.Module:
        model = self.model
        for attr in ("_orig_mod", "module"):  # torch.compile, DDP
            model = getattr(model, attr, model)
        return model

    def record_facts(self) -> dict:
        """{RunRecord field: labkit.facts dataclass} of this strategy; overrides extend super()'s."""
        from labkit.optim import facts
        return {"optim": facts(self.optimizer)}

    def close(self) -> None:
        """Release strategy resources (engines, extra groups)."""


class SingleStrategy(Strategy):
    """One process, the whole model: the baseline every other strategy is compared with."""

    needs_process_group = False
    max_world_size = 1

    def record_facts(self) -> dict:
        from labkit.facts import CommFacts
        return {**super().record_facts(), "comm": CommFacts()}  # one process: nothing is sent


STRATEGY_CLASSES = {"single": SingleStrategy}
