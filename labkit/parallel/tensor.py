"""Tensor parallelism (Megatron-style, with DTensor) and its 2-D composition with FSDP2.

Shoeybi et al. 2019, "Megatron-LM", Sec. 3: in a transformer block, split the first linear of each
pair by COLUMNS (output features) and the second by ROWS (input features). Each rank then computes
its heads / its slice of the MLP width with no communication in between, and one all-reduce after the
row-wise linear restores the full activation (the paper's `g` operator; its backward twin `f` is the
all-reduce of the input gradient in front of the column-wise linears):

    x (B,T,H) --f--> q,k,v = colwise (B,T,a/t*hd)  -> attention on a/t local heads -> o = rowwise --g--> (B,T,H)
    x (B,T,H) --f--> gate,up = colwise (B,T,I/t)   -> silu(gate) * up              -> down = rowwise --g--> (B,T,H)

Per layer and step that is 2 all-reduces forward (o_proj, down_proj) and 5 backward (the input
gradients of q, k, v, gate, up). The embedding is split by vocabulary rows (1 all-reduce forward);
the LM head by vocabulary columns, and its logits stay sharded into the loss: `loss_parallel`
computes the cross-entropy from vocab-sharded logits with three small all-reduces (max, sum of
exp, target logit) instead of gathering (B,T,V) logits -- our choice, so per-rank parameter bytes
are ~1/t and the largest activation of a Llama never exists whole.

Sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2) additionally splits the norm regions by
sequence: each all-reduce becomes a reduce-scatter + all-gather pair (same bytes), and the norms'
activations shrink by t.

Local head counts: HF Llama attention reshapes q/k/v with `view(B, T, -1, head_dim)`, so with
`use_local_output=True` (plain local tensors after each colwise linear) it sees a/t local heads
without any change (torchtitan's approach); GQA's heads-per-kv ratio is unchanged by the split. Any
module attribute that stores a head count (older transformers' `num_heads`) is divided by t.

`tensor-fsdp` (2-D): mesh (dp, tp) -- TP inside (NVLink), FSDP2 across (torchtitan's order: TP
first, then activation checkpointing, then `fully_shard` over the dp dim). Introduced in notebook
07_model_parallel.
"""
from __future__ import annotations


import torch
from torch import nn

from labkit.errors import ConfigError
from labkit.parallel.dims import ParallelDims
from labkit.parallel.single import Strategy

#: Head-count attributes some transformers versions keep on attention modules (divided by tp).
_HEAD_ATTRS = ("num_heads", "num_key_value_heads", "num_attention_heads")


def apply_tensor(model: nn.Module, mesh, *, cfg=None, sequence_parallel: bool | None = None) -> nn.Module:
    """Megatron-style TP of an HF Llama causal LM over the 1-D device mesh `mesh` (in place).

    `sequence_parallel` defaults to `cfg.sequence_parallel` when the config has that field, else False.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if sequence_parallel is None:
        sequence_parallel = bool(getattr(cfg, "sequence_parallel", False))
    tp = mesh.size()
    check_divisible(model.config, tp)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan(sequence_parallel))
        for attr in _HEAD_ATTRS:  # only where a module keeps a head count (not HF Llama 5.x)
            if isinstance(getattr(layer.self_attn, attr, None), int):
                setattr(layer.self_attn, attr, getattr(layer.self_attn, attr) // tp)
    parallelize_module(model, mesh, root_plan(sequence_parallel))
    model.labkit_tp = {"tp": tp, "sequence_parallel": sequence_parallel}
    return model


def apply_tensor_fsdp(model: nn.Module, mesh, *, cfg=None, sequence_parallel: bool | None = None,
                      levers=None) -> nn.Module:
    """2-D: TP over mesh['tp'], then (optional `levers(model)`, e.g. checkpointing) FSDP2 over the other
    dim ('dp_shard' of `ParallelDims.build_mesh`, or 'dp').

    Each decoder layer is one FSDP unit, then the root; parameters become 2-D DTensors sharded by
    heads/width over tp and by dim 0 over dp.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    apply_tensor(model, mesh["tp"], cfg=cfg, sequence_parallel=sequence_parallel)
    if levers is not None:
        model = levers(model)
    amp = getattr(getattr(cfg, "precision", None), "amp", "none")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if amp == "bf16" else None
    dp = next(n for n in mesh.mesh_dim_names if n != "tp")  # 'dp_shard' (ParallelDims) or 'dp'
    kwargs = {"mesh": mesh[dp], **({"mp_policy": mp} if mp else {})}
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _styles():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    return Replicate, Shard, ColwiseParallel, RowwiseParallel, PrepareModuleInput, SequenceParallel


def layer_plan(sequence_parallel: bool = False) -> dict:
    """The TP plan of one HF `LlamaDecoderLayer` (module path -> ParallelStyle)."""
    Replicate, Shard, Colwise, Rowwise, PrepareInput, SeqPar = _styles()
    plan = {f"self_attn.{n}_proj": Colwise() for n in "qkv"}
    plan.update({f"mlp.{n}_proj": Colwise() for n in ("gate", "up")})
    if not sequence_parallel:  # residual stream replicated: row-wise outputs all-reduced (Megatron's g)
        plan.update({"self_attn.o_proj": Rowwise(), "mlp.down_proj": Rowwise()})
        return plan
    # Sequence parallel: the residual stream is a DTensor sharded on the sequence dim (global shape
    # (B, T, H), local (B, T/t, H)); norms run on their shard, attention / MLP all-gather their input,
    # row-wise outputs are reduce-scattered. It stays a DTensor (use_local_output=False) so the
    # residual adds see matching types and HF's position ids are built from the GLOBAL length T.
    seq = dict(output_layouts=Shard(1), use_local_output=False)
    plan.update({
        "input_layernorm": SeqPar(), "post_attention_layernorm": SeqPar(),
        "self_attn": PrepareInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                  desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "mlp": PrepareInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "self_attn.o_proj": Rowwise(**seq), "mlp.down_proj": Rowwise(**seq),
    })
    return plan


def root_plan(sequence_parallel: bool = False) -> dict:
    """Embedding (vocab rows), final norm and LM head (vocab columns, logits left sharded for loss_parallel)."""
    Replicate, Shard, Colwise, Rowwise, _, SeqPar = _styles()
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {"model.embed_tokens": Rowwise(input_layouts=Replicate(), output_layouts=seq,
                                          use_local_output=not sequence_parallel),
            "lm_head": Colwise(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    if sequence_parallel:
        plan["model.norm"] = SeqPar()
    return plan


def check_divisible(config, tp: int) -> None:
    """ConfigError unless tp splits the heads, the kv heads and the MLP width evenly."""
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, field)
        if value % tp:
            raise ConfigError(f"tensor parallel degree {tp} does not divide {field}={value}; "
                              f"use a tp that divides it (e.g. --nproc {_largest_divisor(value, tp)})")


def _largest_divisor(n: int, below: int) -> int:
    return max(d for d in range(1, below + 1) if n % d == 0)


# ------------------------------------------------------------------------------ the design, checked
def expected_collectives(num_layers: int, *, sequence_parallel: bool = False, fused: bool = False) -> dict[str, int]:
    """Collectives per training step (forward + backward) the TP plan implies, by kind.

    Without SP: forward 1 (embedding) + 2 per layer (o_proj, down_proj) all-reduces; backward 5 per
    layer (inputs of q, k, v, gate, up: each column-parallel Linear all-reduces its own input
    gradient) + 1 (LM head input) all-reduces; loss_parallel adds 3 all-reduces (max, sum-exp,
    target logit). `fused=True` counts Megatron-LM's layer instead (Shoeybi et al. 2019, Sec. 3 and
    Fig. 4): q, k, v are ONE column-parallel GEMM and so are gate and up, so each half of the layer
    has one f (its input gradient all-reduced in backward) and one g (all-reduce in forward) --
    2 forward + 2 backward = 4 per layer instead of 7. With SP each row-wise all-reduce becomes a
    reduce-scatter and each colwise-region input an all-gather (and their backward the reverse).
    `tests/test_tensor.py` compares the unfused count with CommDebugMode's, so a wrong plan fails.
    """
    loss = 3
    if not sequence_parallel:
        backward_per_layer = 2 if fused else 5
        return {"all_reduce": 1 + 2 * num_layers + backward_per_layer * num_layers + 1 + loss}
    # forward: embedding reduce-scatter, per layer 2 all-gathers (attn, mlp inputs) + 2 reduce-scatters,
    # LM head all-gather; backward mirrors it (all-gather <-> reduce-scatter).
    per_dir = {"all_gather": 2 * num_layers + 1, "reduce_scatter": 2 * num_layers + 1}
    return {"all_gather": 2 * per_dir["all_gather"], "reduce_scatter": 2 * per_dir["reduce_scatter"],
            "all_reduce": loss}


def count_collectives(fn) -> dict[str, int]:
    """Run `fn()` under CommDebugMode; collectives by short name ('all_reduce', 'all_gather', ...)."""
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode:
        fn()
    out: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = collective_name(op)
        out[name] = out.get(name, 0) + n
    return out


def collective_name(op) -> str:
    """'all_reduce', 'all_gather', ... for a functional collective (DTensor's) or a c10d op (a hand-written
    `dist.all_reduce`, notebook 07's exercise), so the two count under one name."""
    name = str(getattr(op, "__name__", op)).split(".")[-1]
    name = name.replace("_into_tensor", "").replace("_tensor", "").replace("_coalesced", "")
    return C10D_NAMES.get(name.strip("_").replace("_base", ""), name)


#: torch.ops.c10d op names (allreduce_, _allgather_base_, ...) -> the functional names DTensor's count uses.
C10D_NAMES = {"allreduce": "all_reduce", "allgather": "all_gather", "alltoall": "all_to_all",
              "reduce_scatter": "reduce_scatter", "broadcast": "broadcast"}


# ------------------------------------------------------------------------------------------ hook
def tp_degree(cfg, world_size: int) -> int:
    """'tensor': every rank is one TP group. 'tensor-fsdp': TP inside a node (tp = --nproc), DP across."""
    return ParallelDims.for_config(cfg, world_size).tp


def _full(t):
    """A DTensor's global value (loss_parallel returns a replicated DTensor loss), a tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class TensorStrategy(Strategy):
    """Hook for 'tensor' (mesh (1, world)) and 'tensor-fsdp' (mesh (world / tp, tp)).

    TP ranks of one dp group read the SAME batch (dp_rank = rank // tp), so the loss and the update
    equal the single-process ones; the loss runs under `loss_parallel` (vocab-sharded logits).
    """

    def __init__(self, name, ctx, cfg, task):
        super().__init__(name, ctx, cfg, task)  # dims: (dp_shard, tp); dp_rank = rank // tp
        self.tp = self.dims.tp
        self.mesh, self.sequence_parallel = None, bool(getattr(cfg, "sequence_parallel", False))
        self.collectives: dict[str, int] | None = None

    @classmethod
    def check(cls, cfg, world_size: int) -> None:
        if cfg.kind != "llm":
            raise ConfigError(f"strategy {cfg.run.strategy!r} splits transformer heads; {cfg.run.model!r} is not an "
                              "LLM: use --model tiny-llama (or a Llama preset / checkpoint)")
        tp = tp_degree(cfg, world_size)  # ConfigError when the ranks do not form whole TP groups
        from labkit.zoo.models import llm_config
        check_divisible(llm_config(cfg.run.model), tp)
        super().check(cfg, world_size)

    def parallelize(self, model: nn.Module) -> nn.Module:
        # torchtitan's order: TP -> activation checkpointing -> FSDP -> compile.
        from labkit.train import levers

        self.mesh = self.dims.build_mesh(self.ctx.device, ("dp_shard", "tp"))  # (dp, tp), tp innermost
        lever = levers.apply_activation_checkpointing if self.cfg.memory.checkpointing else None
        if self.name == "tensor":
            model = apply_tensor(model, self.mesh["tp"], cfg=self.cfg)
            model = lever(model) if lever else model
        else:
            model = apply_tensor_fsdp(model, self.mesh, cfg=self.cfg, levers=lever)
        return levers.apply_compile(model) if self.cfg.precision.compile else model

    def train_step(self, micro_batches: list, loss_fn):
        from torch.distributed.tensor.parallel import loss_parallel

        def step():  # backward must run inside loss_parallel too
            with loss_parallel():
                return super(TensorStrategy, self).train_step(micro_batches, loss_fn)

        if self.collectives is None:  # the first step doubles as the communication check
            out = {}
            self.collectives = count_collectives(lambda: out.setdefault("loss", step()))
            return _full(out["loss"])
        return _full(step())

    def eval_logits(self, inputs, targets):
        return _full(super().eval_logits(inputs, targets))  # (B, T, V) gathered for accuracy

    def record_facts(self) -> dict:
        from labkit.facts import TensorFacts
        layers = self._unwrapped().config.num_hidden_layers
        return {"tensor": TensorFacts(
            tp=self.tp, dp=self.dp_size, mesh=[self.dp_size, self.tp],
            sequence_parallel=self.sequence_parallel, loss_parallel=True,
            collectives_first_step=self.collectives or {},
            collectives_tp_design_per_micro_batch=expected_collectives(layers, sequence_parallel=self.sequence_parallel))}


STRATEGY_CLASSES = {"tensor": TensorStrategy, "tensor-fsdp": TensorStrategy}
