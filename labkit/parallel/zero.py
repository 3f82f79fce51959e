"""DeepSpeed ZeRO stages 1, 2, 3 and ZeRO-3 with CPU offload.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models":
with N data-parallel ranks, stage 1 (P_os) partitions the optimizer states, stage 2 (P_os+g) also the
gradients, stage 3 (P_os+g+p) also the parameters, so model-state bytes per rank fall from
(2 + 2 + K) Psi to (2 + 2 + K) Psi / N. Stages 1-2 communicate like DDP (reduce-scatter + all-gather
= 2 (N-1)/N Psi per rank); stage 3 adds a parameter all-gather in backward (3 (N-1)/N Psi, Sec. 7).
ZeRO-Offload (Ren et al. 2021) keeps the fp32 master weights and Adam moments in host memory and
steps them with DeepSpeedCPUAdam; `zero3-offload` also offloads the parameter partitions.

`deepspeed.initialize` turns the model into an engine; the engine's optimizer owns the flat
partitions. The JSON config is written to OUT/ds_config_<strategy>.json: it is a complete DeepSpeed
config (optimizer included) that works with the `deepspeed` launcher and HF Trainer too.
Introduced in notebook 05_zero.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from labkit.runtime import device as devices
from labkit.errors import ConfigError
from labkit.parallel import comm, loading
from labkit.parallel.deepspeed_bytes import (count_bytes, ds_grad_tensors, ds_optimizer_tensors, ds_param_tensors,
                                             master_partitions)
from labkit.parallel.single import Strategy
from labkit.train.metrics import ResidentBytes

#: registry name -> (ZeRO stage, offload to CPU)
VARIANTS = {"zero1": (1, False), "zero2": (2, False), "zero3": (3, False), "zero3-offload": (3, True)}


def apply_zero(model: nn.Module, group, *, cfg, config: dict):
    """`deepspeed.initialize` over the already-initialised process group; returns (engine, optimizer).

    DeepSpeed finds the torch.distributed group torchrun set up (gloo on CPU, nccl on GPUs) and
    partitions at construction: ZeRO-3 replaces each parameter's data by a 1/N `ds_tensor` shard.
    """
    if group is None:
        raise ConfigError(f"{cfg.run.strategy} needs a process group: launch with --nproc N (torchrun)")
    deepspeed = import_deepspeed(next(model.parameters()).device)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    return engine, optimizer


# ------------------------------------------------------------------------------------------ config
def _bucket_sizes(hidden: int | None, numel: int, prefetch: bool) -> dict:
    """Bucket and threshold sizes as transformers' DeepSpeed integration fills its "auto" values
    (reduce bucket hidden^2, prefetch 0.9 hidden^2, persistence 10 hidden). DeepSpeed's own defaults
    (5e8-element buckets, 1e5 persistence) would allocate a 2 GB fp32 bucket per rank and, on the tiny
    smoke model whose tensors are all < 1e5 elements, partition nothing at stage 3.

    Stage-3 release: DeepSpeed keeps a gathered parameter if it is used again within
    stage3_max_reuse_distance (default 1e9) parameters -- for any model below 1e9 parameters that is
    all of them, from forward to backward (ZeRO-2 memory); 0 releases each layer after use, as the
    paper's P_os+g+p. Prefetching overlaps all-gathers with GPU compute; there is nothing to overlap
    on CPU/gloo, and its bookkeeping keeps parameters it skipped as available gathered (measured:
    the whole tiny model), so CPU runs switch it off.
    """
    h2 = hidden * hidden if hidden else min(numel, 50_000_000)
    return {"reduce_bucket_size": h2, "allgather_bucket_size": h2,
            "stage3_prefetch_bucket_size": int(0.9 * h2) if prefetch else 0,
            "stage3_param_persistence_threshold": 10 * hidden if hidden else 100_000,
            "stage3_max_reuse_distance": 0}


#: DeepSpeed's fp16 loss scaler set to behave as torch's GradScaler (the ddp/fsdp runs of 05 use it), so
#: an fp16 node (v100x4, t4x2) skips the same overflow steps in both (issue 38, G6): GradScaler starts at
#: 2^16, halves on EVERY overflow (DeepSpeed's default hysteresis 2 halves only on the second) and doubles
#: after 2000 clean steps; DeepSpeed doubles when (steps since the last overflow - 1) is a multiple of its
#: window, i.e. after window + 1 clean steps: 1999 lands the first doubling on GradScaler's step. Later
#: doublings drift by a step per 2000 (DeepSpeed every 1999 after that), beyond any lab's run.
#: tests/test_loss_scalers.py feeds both scalers one overflow sequence. min_loss_scale 1 (DeepSpeed raises
#: there; GradScaler has no floor) is never reached by a healthy run.
FP16_LOSS_SCALE = {"loss_scale": 0, "initial_scale_power": 16, "hysteresis": 1, "consecutive_hysteresis": False,
                   "loss_scale_window": 1999, "min_loss_scale": 1}


def ds_config(cfg, stage: int, offload: bool, *, dp: int, hidden: int | None, numel: int,
              gpu: bool = False, cast_buffers: bool = False) -> dict:
    """The DeepSpeed JSON config of one run (a resolved TrainConfig `cfg`).

    The optimizer matches the harness's AdamW (betas 0.9/0.999, eps 1e-8, no weight decay) so losses
    compare with ddp: `torch_adam` makes DeepSpeed use torch.optim.AdamW; with offload DeepSpeed
    always uses its own DeepSpeedCPUAdam (a C++ op built on first use).

    `cast_buffers` (vision models): with bf16/fp16 on, DeepSpeed >= 0.19 casts the parameters only and
    keeps buffers in their dtype (right for Llama's fp32 rotary `inv_freq`), which leaves BatchNorm with
    16-bit weights and fp32 running statistics, a combination batch_norm refuses ("expected scalar
    type BFloat16 but found Float", measured on CPU); `data_types.buffer_dtype` casts them too, as
    DeepSpeed's older whole-module `.bfloat16()` did.
    """
    if cfg.optim.batch % (dp * cfg.optim.accum):
        raise ConfigError(f"global batch {cfg.optim.batch} does not split into {dp} ranks x {cfg.optim.accum} micro-batches")
    buckets = _bucket_sizes(hidden, numel, prefetch=gpu)
    # overlap_comm: reduce (stages 1-2: reduce-scatter gradient buckets) / all-gather on DeepSpeed's side
    # streams while backward computes, at the cost of extra bucket buffers (DeepSpeed's ZeRO config docs;
    # its stage-3 default). Only on GPUs: a CPU run has no streams to overlap on (over gloo it runs and
    # gives the same losses for stages 1-3, measured with DeepSpeed 0.19.8, but only adds buffers).
    # Unverified on hardware: the speed-up.
    zero = {"stage": stage, "overlap_comm": gpu, "contiguous_gradients": True,
            "reduce_bucket_size": buckets["reduce_bucket_size"]}
    if stage < 3:
        zero["allgather_bucket_size"] = buckets["allgather_bucket_size"]
    else:
        zero.update({k: v for k, v in buckets.items() if k.startswith("stage3")},
                    stage3_gather_16bit_weights_on_model_save=True)
    if offload:
        # Pinned (page-locked) host memory speeds up copies to the GPU; pinning needs the CUDA driver.
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": gpu}
        zero["offload_param"] = {"device": "cpu", "pin_memory": gpu}
    adam = {"lr": cfg.optim.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    if not offload:
        adam["torch_adam"] = True
    return {
        "train_batch_size": cfg.optim.batch,
        "train_micro_batch_size_per_gpu": cfg.optim.batch // dp // cfg.optim.accum,
        "gradient_accumulation_steps": cfg.optim.accum,
        "optimizer": {"type": "AdamW", "params": adam},
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.precision.amp == "bf16"},
        "fp16": {"enabled": cfg.precision.amp == "fp16", **FP16_LOSS_SCALE},
        **({"data_types": {"buffer_dtype": cfg.precision.amp}} if cast_buffers and cfg.precision.amp in ("bf16", "fp16") else {}),
        "gradient_clipping": 0.0,
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }


def stand_in_precision(config: dict, name: str) -> tuple[dict, str]:
    """(the config DeepSpeed initialises with, a note for the record). A rehearsal's CPU stands in for the
    GPU; DeepSpeed's CPU accelerator has fp16 only where oneDNN has fp16 kernels (not on this course's
    CPUs: "Type fp16 is not supported on your device"), so a V100 profile's fp16 config runs there as
    bf16 -- the same code paths but the loss scaler -- and the record says so. The node's config (the
    written ds_config file, the record's dtype) stays fp16. Anywhere else: `config` unchanged, no note."""
    if not (config["fp16"]["enabled"] and devices.standing_in()):
        return config, ""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():
        return config, ""
    note = (f"rehearsal: {name} ran bf16 in place of the node's fp16 (DeepSpeed's CPU accelerator has no fp16 "
            "here); the loss scaler did not run")
    return {**config, "fp16": {"enabled": False}, "bf16": {"enabled": True},
            **({"data_types": {"buffer_dtype": "bf16"}} if "data_types" in config else {})}, note


def write_config(config: dict, out: str | os.PathLike, strategy: str) -> Path:
    """Write `config` to OUT/ds_config_<strategy>.json (call on rank 0) and return the path."""
    path = Path(out) / f"ds_config_{strategy}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


def import_deepspeed(device: torch.device):
    """`import deepspeed`, checking it picked the accelerator of `device` (DS_ACCELERATOR=cpu on CPU)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if device.type == "cpu" and name != "cpu":
        raise ConfigError(f"DeepSpeed chose accelerator {name!r} on a CPU run: set DS_ACCELERATOR=cpu in the "
                          "environment BEFORE deepspeed is imported (`labkit train` does this for zero*)")
    return deepspeed


def comm_bytes_per_step(stage: int, param_bytes: int, n: int, microbatches: int = 1) -> dict[str, int]:
    """Bytes each rank sends per step (ring, (n-1)/n x size per collective; ZeRO paper Sec. 7.2).

    Stages 1-2: reduce-scatter the gradients, all-gather the updated parameters (= DDP's all-reduce).
    Stage 3: parameters are all-gathered in forward AND in backward: 1.5x data parallelism. That is for
    one micro-batch per step: with `microbatches` m, stage 2 reduce-scatters every micro-batch and stage 3
    gathers and reduces every micro-batch (`labkit.parallel.comm.dp_passes`).
    """
    ring = int(comm.bytes_sent("reduce_scatter", param_bytes, n))  # = all-gather's
    gathers, scatters = comm.dp_passes(stage, microbatches)
    return {"reduce_scatter": ring * scatters, "all_gather": ring * gathers}


# ------------------------------------------------------------------------------------------ hook
class ZeroStrategy(Strategy):
    """DeepSpeed hook: the engine does backward (loss / accum), reduction and the partitioned step."""

    def __init__(self, name, ctx, cfg, task):
        super().__init__(name, ctx, cfg, task)
        self.stage, self.offload = VARIANTS[name]
        self.engine = None
        self.ds_optimizer = None
        self.config: dict = {}
        self.stand_in_note = ""
        self.config_path: Path | None = None
        self._grad_peak = self._param_peak = (0, 0)  # (bytes on device, bytes elsewhere)
        self._hooks: list = []
        self._steps = 0

    @classmethod
    def launch_env(cls, cfg) -> dict[str, str]:
        # Must be in the environment before `import deepspeed` (it picks the accelerator at import).
        return {"DS_ACCELERATOR": "cpu"} if cfg.profile.device == "cpu" else {}

    @classmethod
    def check(cls, cfg, world_size: int) -> None:
        super().check(cfg, world_size)
        if cfg.precision.compile:
            raise ConfigError(f"--compile is not wired for {cfg.run.strategy}: DeepSpeed compiles through its engine "
                              "(engine.compile()); drop --compile or use --strategy fsdp")

    def build_model(self) -> nn.Module:
        if self.task.kind != "llm":
            return super().build_model()
        # Rank 0 reads/initialises the model; the others allocate empty and receive a broadcast.
        model = loading.build_on_rank0(self.cfg.run.model, self.ctx.rank, seed=self.cfg.run.seed)
        return loading.sync_module_states(model, self.ctx.group, self.ctx.device)

    def setup(self) -> None:
        model = self.parallelize(self.build_model())
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        numel = sum(p.numel() for p in model.parameters())
        self.config = ds_config(self.cfg, self.stage, self.offload, dp=self.dp_size, hidden=hidden, numel=numel,
                                gpu=devices.is_gpu(self.ctx.device), cast_buffers=self.task.kind == "vision")
        if self.ctx.is_main:
            self.config_path = write_config(self.config, self.cfg.run.out, self.name)
        runs, self.stand_in_note = stand_in_precision(self.config, self.name)
        if self.stand_in_note:
            from labkit.train import levers
            self.precision = levers.Precision("bf16", self.ctx.device)  # evaluation's autocast matches the engine
            if self.ctx.is_main:
                print(self.stand_in_note)
        self.engine, self.ds_optimizer = apply_zero(model, self.ctx.group, cfg=self.cfg, config=runs)
        # The loop sees the engine as the model and the torch optimizer DeepSpeed steps on the flat fp32
        # partitions as the optimizer (a real torch Optimizer, so memory tracking can follow it).
        self.model = self.engine
        self.optimizer = getattr(self.ds_optimizer, "optimizer", self.ds_optimizer)
        self._hooks = [self.engine.module.register_forward_hook(self._after_forward)]
        if self.stage == 1:
            # Stage 1 keeps every full .grad until the end of backward, then reduces and frees them
            # inside engine.backward: only a hook during backward sees that peak. Stages 2-3 reduce
            # bucket by bucket as gradients appear; their state after backward is what they hold.
            self._hooks += [p.register_post_accumulate_grad_hook(self._note_grads)
                            for p in self.engine.module.parameters() if p.requires_grad]

    def _note_grads(self, *_) -> None:
        if self._steps < 3:  # the loop measures memory in its first steps; skip the cost afterwards
            (grads,) = count_bytes([ds_grad_tensors(self.engine.module, self.ds_optimizer)], self.ctx.device)
            self._grad_peak = max(self._grad_peak, grads, key=sum)

    def _after_forward(self, module, args, output) -> None:
        # What a rank holds between forward and backward (stage 3: partitions + persistent params).
        if module.training and torch.is_grad_enabled() and self._steps < 3:
            (held,) = count_bytes([ds_param_tensors(module)], self.ctx.device)
            self._param_peak = max(self._param_peak, held, key=sum)

    def _cast_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        """Float inputs in the engine's dtype: with bf16/fp16 enabled DeepSpeed casts the model, not
        the batch (its fp16 `auto_cast` is off by default and has no bf16 twin), so an fp32 image batch
        meets bf16 conv weights ("Input type (float) and bias type (BFloat16) should be the same",
        DeepSpeed issue 6789). Token ids and labels are integers and stay as they are."""
        dtype = self.engine.get_data_types()[0]
        return inputs.to(dtype) if inputs.is_floating_point() and inputs.dtype != dtype else inputs

    def eval_logits(self, inputs, targets):
        return super().eval_logits(self._cast_inputs(inputs), targets)

    def train_step(self, micro_batches: list, loss_fn):
        total = None
        for inputs, targets in micro_batches:
            loss = loss_fn(self.engine, self._cast_inputs(inputs), targets)
            self.engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
            self._note_grads()
            self.engine.step()  # a no-op except at the accumulation boundary
            part = loss.detach() / len(micro_batches)
            total = part if total is None else total + part
        self._steps += 1
        return total

    # ------------------------------------------------------------------ accounting
    def resident_bytes(self) -> ResidentBytes:
        """Parameter partitions, gradient peak (full .grad before reduction included), fp32 master
        partitions + optimizer states; with offload, the bytes the config places in host memory."""
        module = self.engine.module
        self.engine.empty_partition_cache()  # stage 3: an eval forward leaves parameters gathered
        params, grads, optim = count_bytes([ds_param_tensors(module), ds_grad_tensors(module, self.ds_optimizer),
                                            ds_optimizer_tensors(self.ds_optimizer)], self.ctx.device)
        grads = max(grads, self._grad_peak, key=sum)
        params = max(params, self._param_peak, key=sum)
        if not devices.is_gpu(self.ctx.device):
            offload = sum(params) + sum(grads) + sum(optim) if self.offload else 0
            return ResidentBytes(sum(params), sum(grads), sum(optim), offload)
        return ResidentBytes(params[0], grads[0], optim[0], params[1] + grads[1] + optim[1])

    def _numel(self) -> dict[int, int]:
        return {id(p): getattr(p, "ds_numel", p.numel()) for p in self.engine.module.parameters() if p.requires_grad}

    def trainable_params(self) -> int:
        return sum(self._numel().values())

    def flops_per_step(self, global_tokens: int) -> float | None:
        if self.task.kind != "llm":
            return None
        embed = self.engine.module.get_input_embeddings().weight
        return 6.0 * (self.trainable_params() - getattr(embed, "ds_numel", embed.numel())) * global_tokens

    def record_facts(self) -> dict:
        from deepspeed.accelerator import get_accelerator

        from labkit.facts import CommFacts, MemoryFacts, ShardingFacts
        master = count_bytes([ds_param_tensors(self.engine.module), master_partitions(self.ds_optimizer)],
                             self.ctx.device)[1]
        param_bytes = sum(self._numel().values()) * 4 if self.cfg.precision.amp == "none" else sum(self._numel().values()) * 2
        return dict(sharding=ShardingFacts(
                        zero_stage=self.stage, ds_accelerator=get_accelerator().device_name(),
                        ds_config=str(self.config_path or Path(self.cfg.run.out) / f"ds_config_{self.name}.json"),
                        ds_optimizer=type(self.optimizer).__name__),
                    memory=MemoryFacts(offload=bool(self.offload), master_copy_bytes=sum(master),
                                       offload_physical=bool(self.offload) and devices.is_gpu(self.ctx.device)),
                    comm=CommFacts.of(comm_bytes_per_step(self.stage, param_bytes, self.dp_size, self.cfg.optim.accum)),
                    **({"notes": {"stand_in_precision": self.stand_in_note}} if self.stand_in_note else {}))

    # ------------------------------------------------------------------ checkpoint / teardown
    def save_checkpoint(self, path: Path) -> None:
        # DeepSpeed's own format: one file per rank for the partitions (zero_to_fp32.py consolidates).
        self.engine.save_checkpoint(str(path), tag="zero", save_latest=False)
        self._save_rank_state(path)

    def load_checkpoint(self, path: Path) -> None:
        self.engine.load_checkpoint(str(path), tag="zero")
        self._load_rank_state(path)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        if self.engine is not None:
            self.engine.destroy()


STRATEGY_CLASSES = {name: ZeroStrategy for name in VARIANTS}
