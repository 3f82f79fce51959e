"""3-D parallelism planner: which (dp, tp, pp, ZeRO stage, micro-batches) trains MODEL on N GPUs?

Pure Python, no torch. For every layout that is valid it asks the memory estimator
(`labkit.memory.estimate`, the ZeRO paper's accounting) for bytes per GPU, adds a communication and
bubble model, and ranks the layouts that fit by estimated step time. Invalid layouts are kept with
the reason (`check_layout`), so "TP=8, PP=8, DP=8 on 64 GPUs" answers "tp(8) * pp(8) * dp(8) = 512
!= gpus(64)".

Rules (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 3 "takeaways"):
- TP inside a node: its all-reduces are on the critical path of every layer, so tp <= GPUs per node
  (NVLink); a larger tp is rejected.
- PP across nodes: only activations of one micro-batch cross a stage boundary (point-to-point).
- DP outermost; every ZeRO stage composes with PP (Megatron's distributed optimizer is ZeRO-1; Llama 3
  shards gradients too, ZeRO-2; torchtitan runs FSDP x TP x PP). The price is in the time model: ZeRO-2
  reduces gradients every micro-batch, ZeRO-3 gathers the parameters every micro-batch.

Time model: `labkit.parallel.perf_model` (matmuls at an achievable efficiency, memory-bound non-matmul work,
recomputation by checkpointing mode, TP communication exposed, DP collectives layer by layer, hidden only
behind the compute next to them: `labkit.parallel.perf_dp`), its constants fitted to published runs and
checked on held-out ones (`labkit.parallel.published_runs`, `bench/planner_heldout.py`). Every plan says
which matmul efficiency it assumed and where it came from. `budget` turns a layout into days and cost.
Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from labkit.errors import ConfigError, choices_error
from labkit.parallel import hardware, perf_model
from labkit.parallel.dims import ParallelDims  # noqa: F401
from labkit.parallel.plan_checks import (MICRO_BATCH_SIZES, RELIEF, check_layout, layout_dims,  # noqa: F401
                                         no_micro_batching, overflow)
from labkit.parallel.perf_model import GPUS, Budget, Efficiency, GpuSpec, budget  # noqa: F401 (re-exported)

#: Share of HBM the plan may fill: the rest is the CUDA context (~0.5-1 GB), NCCL's buffers (~1-2 GB) and
#: allocator fragmentation, which the estimator does not count. 5 %: with expandable segments the
#: fragmentation of a steady training loop stays small, and tuned production runs fill their GPUs (Llama 3
#: 405B trained 8K sequences without recomputation on 80 GB H100s: Dubey et al. 2024 Sec. 3.3.2).
USABLE = 0.95


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for. `batch` is the GLOBAL batch in sequences (default 8 per GPU)."""

    model: str
    """A preset, a Hugging Face id in the local cache, a folder or a config.json (`labkit memory estimate`'s)."""
    gpus: int
    gpus_per_node: int
    gpu: str = "a100-80gb"
    batch: int | None = None
    seq: int | None = None
    """Tokens per sequence; default min(model context, 2048)."""
    checkpointing: str = "full"
    """Activation recomputation assumed for every layout: 'full', 'selective' or 'none'."""
    usable: float = USABLE
    matmul_efficiency: float | None = None
    """Share of peak the GEMMs reach; None = `measured` if given, else the fitted default."""
    measured: str | None = None
    """A `labkit preflight` measurement file to plan with instead of the fitted efficiency (read only if given)."""
    inter_node_gbps: float | None = None
    """Inter-node bandwidth per GPU, Gb/s; None = the GPU's system default (A100 200, H100/H200/B200 400)."""
    interleave: int = 1
    """Virtual pipeline stages per rank for layouts with pp > 1 (Narayanan et al. 2021 Sec. 2.2.2)."""
    flash: bool = True
    """Fused (flash) attention; False = the softmax kernels of 2021-22 Megatron (s x s scores in HBM)."""
    sequence_parallel: bool = True
    """Sequence parallelism under TP (Korthikanti et al. 2022)."""
    precision: str = "bf16"
    """bf16 (V100: fp16) or fp8 (H100/H200/B200 linears on FP8 tensor cores)."""
    fsdp: bool = False
    """ZeRO-3 layouts as torch FSDP (the recomputed forward reuses the backward's gather) rather than DeepSpeed."""
    fused_kernels: bool = True
    """Fused norm / SwiGLU kernels (Megatron, Meta, torch.compile): their activation memory and HBM traffic;
    False = Hugging Face's eager modules (more saved activations, one kernel per elementwise op)."""
    stack: str = "megatron"
    """Software stack (`hardware.STACKS`): megatron (Megatron-Core/NeMo, fused TE kernels), torch-compile, eager."""
    attention: str = ""
    """Attention kernel (`hardware.ATTENTION_KERNELS`): fa2, sdpa, fa3 (or cuDNN, Hopper+), triton, eager;
    '' = the GPU's default (`hardware.default_attention`: fa2 from the A100 on, sdpa before)."""
    tp_overlap: bool = False
    """TP collectives overlapped with the GEMMs beside them (Megatron's --tp-comm-overlap, torchtitan's AsyncTP)."""
    optimizer_states: str = "fp32"
    """Adam's moments in fp32 or bf16 (memory and the optimizer step's bytes)."""
    zero_stages: tuple = (0, 1, 2, 3)
    """ZeRO stages the search tries: those the run's software has (Megatron-Core: 0, 1 -- its distributed
    optimizer -- and 3 -- Megatron-FSDP / torch FSDP; no ZeRO-2: `published_runs.ZERO_STAGES`)."""
    efficiency: Efficiency | None = None
    """Filled in (`labkit.parallel.hardware.matmul_efficiency`): value and source."""

    def __post_init__(self) -> None:
        spec = model_spec_of(self.model)
        self.__dict__["model_spec"] = spec  # the cached_property's slot: resolved once
        for name in ("gpus", "gpus_per_node", "batch", "seq", "interleave"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name}={value!r}; it must be a positive integer")
        object.__setattr__(self, "gpu", hardware.canonical(self.gpu))
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise ConfigError(f"gpus={self.gpus} is not a whole number of nodes of {self.gpus_per_node}; "
                              f"use a multiple of {self.gpus_per_node}")
        if self.inter_node_gbps is not None and not self.inter_node_gbps > 0:
            raise ConfigError(f"inter_node_gbps={self.inter_node_gbps!r}; give the per-GPU bandwidth, e.g. 200")
        if self.batch is None:
            object.__setattr__(self, "batch", 8 * self.gpus)
        if self.seq is None:
            object.__setattr__(self, "seq", min(spec.arch["max_seq"], 2048))
        if not self.zero_stages or not set(self.zero_stages) <= {0, 1, 2, 3}:
            raise ConfigError(f"zero_stages={self.zero_stages!r}; give some of 0, 1, 2, 3, e.g. (0, 1, 3)")
        if self.checkpointing not in ("full", "selective", "none"):
            raise choices_error("checkpointing", self.checkpointing, ("full", "selective", "none"))
        for name, allowed in (("stack", hardware.STACKS), ("attention", ("",) + tuple(hardware.ATTENTION_KERNELS)),
                              ("optimizer_states", hardware.OPTIMIZER_STATES)):
            if getattr(self, name) not in allowed:
                raise choices_error(name, getattr(self, name), allowed)
        if self.attention == "eager":
            object.__setattr__(self, "flash", False)
        object.__setattr__(self, "attention", self.attention or hardware.default_attention(self.gpu))
        if self.flash:
            hardware.attention_efficiency(self.gpu, self.attention)  # ConfigError: a kernel this GPU cannot run
        precision = hardware.default_precision(self.gpu) if self.precision == "bf16" else self.precision
        object.__setattr__(self, "efficiency", hardware.matmul_efficiency(
            self.gpu, precision, override=self.matmul_efficiency, measured=self.measured))

    @property
    def spec(self) -> GpuSpec:
        return hardware.gpu_spec(self.gpu)

    @functools.cached_property
    def model_spec(self):
        """Resolved once per request (the search asks for it for every layout)."""
        return model_spec_of(self.model)

    @property
    def capacity_bytes(self) -> float:
        return self.spec.memory_gb * 1e9 * self.usable


def model_spec_of(model: str):
    """The `ModelSpec` of what `labkit memory estimate` accepts, if the planner can split it."""
    from labkit.memory.estimate import MemoryConfig, spec_of

    spec = spec_of(MemoryConfig(model=model))
    if spec.kind == "vision":
        raise ConfigError(f"the planner splits transformers; {model!r} is a vision model: use an LLM or "
                          "GPT preset such as gpt3-175b or llama2-7b, or a transformer's config.json")
    if spec.kind == "params":
        raise ConfigError(f"{model!r} is counted but its layers are not modelled (families: llama, mistral, "
                          "qwen2, mixtral, gpt2, gpt_neox, bloom, opt, falcon); the planner needs them")
    return spec


@dataclass(frozen=True)
class Option:
    """One layout with its memory, communication, bubble and time estimates."""

    dp: int
    tp: int
    pp: int
    zero: int
    microbatches: int
    micro_batch: int
    memory_bytes: int
    fits: bool
    bubble: float
    comm_s: dict = field(default_factory=dict)
    """Seconds per step by dimension: tp, pp, dp."""
    comm_bytes: dict = field(default_factory=dict)
    """Bytes each GPU sends per step by dimension."""
    compute_s: float = 0.0
    """Matmul + non-matmul seconds per step (recomputation included), before the bubble."""
    step_s: float = 0.0
    mfu: float = 0.0
    """Model FLOPs (forward + backward, no recomputation) / (N peak step_s)."""
    hfu: float = 0.0
    """Hardware FLOPs (recomputation included) / (N peak step_s)."""
    tflops_per_gpu: float = 0.0
    """Hardware TFLOPS per GPU (recomputation included, as Megatron-LM reports it)."""
    cp: int = 1
    """Context-parallel degree (long sequences only)."""
    ep: int = 1
    """Expert-parallel degree (MoE models only)."""
    tokens_per_s_per_gpu: float = 0.0
    dp_comm_s: float = 0.0
    """All data-parallel communication per step, hidden or not (`comm_s['dp']` is the exposed part)."""
    interleave: int = 1
    overflow: str = ""
    """Why it does not fit: the estimate against the usable memory and its largest term ('' when it fits)."""

    @property
    def dims(self) -> ParallelDims:
        return layout_dims(self.dp, self.tp, self.pp, self.zero, cp=self.cp, ep=self.ep)

    @property
    def layout(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("cp", self.cp), ("ep", self.ep)) if v > 1)
        return f"dp={self.dp} tp={self.tp} pp={self.pp}{extra} zero={self.zero} m={self.microbatches}"

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "layout": self.layout, "memory_gb": round(self.memory_bytes / 1e9, 2)}


def layout_of(req: PlanRequest, dp: int, tp: int, pp: int, zero: int, micro_batch: int, *, cp: int = 1,
              ep: int = 1) -> perf_model.Layout:
    """The time model's `Layout` of one layout of `req` (its switches: interleave, flash, SP, precision...)."""
    return perf_model.Layout(dp=dp, tp=tp, pp=pp, micro_batch=micro_batch, microbatches=req.batch // dp // micro_batch,
                             checkpointing=req.checkpointing, zero=zero, sequence_parallel=req.sequence_parallel and tp > 1,
                             interleave=req.interleave if pp > 1 else 1, flash=req.flash, cp=cp, ep=ep,
                             fsdp=req.fsdp, precision=req.precision, fused_kernels=req.fused_kernels,
                             eager=not req.fused_kernels, stack=req.stack,
                             attention=req.attention if req.flash else "eager", tp_overlap=req.tp_overlap and tp > 1,
                             optimizer_states=req.optimizer_states)


def evaluate(req: PlanRequest, dp: int, tp: int, pp: int, zero: int, micro_batch: int, *,
             cp: int | None = None, ep: int = 1) -> Option:
    """Memory (estimator) and step time (`labkit.parallel.perf_model`) of one valid layout. `cp` defaults to what
    the GPU count leaves, gpus / (dp tp pp) (1 when they already multiply to it), so a row of the plan's table
    given by its dp, tp, pp, zero and micro-batch is that row."""
    from labkit.memory.estimate import MemoryConfig, estimate

    if cp is None:
        cp = req.gpus // (dp * tp * pp) if req.gpus % (dp * tp * pp) == 0 else 1

    per_replica = req.batch // dp
    m = per_replica // micro_batch
    sp = req.sequence_parallel and tp > 1
    cfg = MemoryConfig(model=req.model, precision="mixed-bf16", zero=zero, dp=dp, tp=tp, pp=pp, gpus=req.gpus,
                       batch=per_replica, grad_accum=m, seq=req.seq, checkpointing=req.checkpointing,
                       sequence_parallel=sp, cp=cp, ep=ep, flash_attention=req.flash,
                       fused_kernels=req.fused_kernels, optimizer_states=req.optimizer_states)
    est = estimate(cfg)
    spec = req.model_spec
    share = est.weights / 2 / spec.params * (dp * cp if zero == 3 else 1)  # weights are 2 B/param before ZeRO-3
    lay = layout_of(req, dp, tp, pp, zero, micro_batch, cp=cp, ep=ep)
    t = perf_model.step_time(spec, lay, seq=req.seq, gpu=req.gpu, gpus_per_node=req.gpus_per_node,
                             efficiency=req.efficiency, params_on_gpu=share * spec.params,
                             inter_node_gbps=req.inter_node_gbps)
    comm = {"tp": t.tp_s, "pp": t.pp_s, "dp": t.dp_s, **({"cp": t.cp_s} if cp > 1 else {}),
            **({"ep": t.ep_s} if ep > 1 else {})}
    return Option(dp=dp, tp=tp, pp=pp, zero=zero, microbatches=m, micro_batch=micro_batch,
                  memory_bytes=est.total, fits=est.total <= req.capacity_bytes, bubble=round(t.bubble, 4),
                  overflow=overflow(est, req.capacity_bytes, req.optimizer_states),
                  comm_s={k: round(v, 4) for k, v in comm.items()}, comm_bytes=t.comm_bytes,
                  compute_s=round(t.matmul_s + t.nonmatmul_s, 4), step_s=round(t.step_s, 4), mfu=round(t.mfu, 4),
                  hfu=round(t.hfu, 4), tflops_per_gpu=round(t.tflops_per_gpu, 1), cp=cp, ep=ep,
                  tokens_per_s_per_gpu=round(t.tokens_per_s_per_gpu, 1), dp_comm_s=round(t.dp_total_s, 4),
                  interleave=lay.interleave)


def assumption(req: PlanRequest) -> dict:
    """The matmul efficiency a plan assumed and its source (JSON and text output)."""
    return {"matmul_efficiency": req.efficiency.value, "source": req.efficiency.source,
            "peak_tflops": req.spec.fp8_tflops if req.precision == "fp8" else req.spec.peak_tflops,
            "precision": req.precision, "stack": req.stack, "attention": req.attention if req.flash else "eager",
            "attention_efficiency": hardware.attention_efficiency(req.gpu, req.attention if req.flash else "sdpa"),
            "tp_overlap": req.tp_overlap, "optimizer_states": req.optimizer_states,
            "comm_efficiency": hardware.comm_efficiency("nvlink"),
            "network_efficiency": hardware.comm_efficiency("network"),
            "inter_node_gbps": req.inter_node_gbps or req.spec.inter_node_gbps}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Plan:
    """Every layout of a request: ranked options that fit, those that do not, and rejected ones."""

    request: PlanRequest
    fits: list
    too_big: list
    rejected: list
    """(dp, tp, pp, reason) for layouts `check_layout` refuses."""

    def to_dict(self, top: int | None = None) -> dict:
        return {"request": dataclasses.asdict(self.request), "capacity_gb": self.request.capacity_bytes / 1e9,
                "assumption": assumption(self.request),
                "fits": [o.to_dict() for o in self.fits[:top]], "too_big": [o.to_dict() for o in self.too_big[:top]],
                "rejected": [dict(dp=d, tp=t, pp=p, reason=r) for d, t, p, r in self.rejected]}


def _cp_degrees(req: PlanRequest, rest: int) -> list[int]:
    """Context-parallel degrees to try: every divisor of the GPUs left that splits the sequence evenly (NVIDIA's
    Llama 3 70B recipe runs cp=2 at 8K tokens; the others are rejected with the reason by `check_layout`)."""
    return _divisors(rest)


def _ep_degrees(req: PlanRequest, dp: int) -> list[int]:
    """Expert-parallel degrees to try: only for MoE models, dividing dp and the expert count."""
    experts = req.model_spec.arch.get("experts", 0)
    return [e for e in _divisors(dp) if e == 1 or (experts and experts % e == 0)]


def plan(req: PlanRequest) -> Plan:
    """Enumerate (dp, tp, pp[, cp, ep]) with dp*tp*pp*cp = gpus, ZeRO stages and micro-batch sizes;
    rank what fits. cp is tried wherever it splits the sequence, ep for models with experts. A layout with no
    valid micro-batching is kept in `rejected` with the reason, like one `check_layout` refuses."""
    options, rejected = [], []
    for tp in _divisors(req.gpus):
        for pp in _divisors(req.gpus // tp):
            for cp in _cp_degrees(req, req.gpus // (tp * pp)):
                dp = req.gpus // (tp * pp * cp)
                try:
                    check_layout(req, dp, tp, pp, cp=cp)
                except ConfigError as exc:
                    rejected.append((dp, tp, pp, str(exc)))
                    continue
                found = [o for ep in _ep_degrees(req, dp) for o in _options(req, dp, tp, pp, cp, ep)]
                if not found:
                    rejected.append((dp, tp, pp, no_micro_batching(req, dp, pp, cp)))
                options += found
    options.sort(key=lambda o: (o.step_s, o.memory_bytes))
    return Plan(req, [o for o in options if o.fits], [o for o in options if not o.fits], rejected)


def _options(req: PlanRequest, dp: int, tp: int, pp: int, cp: int, ep: int) -> list:
    """Every ZeRO stage and micro-batch size of one valid (dp, tp, pp, cp, ep)."""
    out = []
    for zero in [z for z in range(4 if dp > 1 else 1) if z in req.zero_stages or dp == 1]:
        for b in MICRO_BATCH_SIZES:
            per_replica = req.batch // dp
            m = per_replica // b if per_replica % b == 0 else 0
            if m < (pp if pp > 1 else 1) or (req.interleave > 1 and pp > 1 and m % pp):
                continue
            out.append(evaluate(req, dp, tp, pp, zero, b, cp=cp, ep=ep))
    return out


def format_plan(p: Plan, top: int = 10) -> str:
    """A text table of the best `top` layouts that fit, then why the others do not."""
    r = p.request
    head = (f"{r.model} on {r.gpus} x {r.gpu} ({r.gpus // r.gpus_per_node or 1} node(s) x {r.gpus_per_node}), "
            f"global batch {r.batch} x {r.seq} tokens, usable {r.capacity_bytes / 1e9:.0f} GB/GPU")
    cols = f"{'rank':>4} {'dp':>3} {'tp':>3} {'pp':>3} {'zero':>4} {'m':>4} {'b':>2} {'GB/GPU':>7} {'bubble':>6} " \
           f"{'tp_s':>6} {'pp_s':>6} {'dp_s':>6} {'step_s':>7} {'mfu':>5} {'hfu':>5} {'TFLOPS':>6}"
    lines = [head, cols]
    for i, o in enumerate(p.fits[:top], 1):
        lines.append(f"{i:>4} {o.dp:>3} {o.tp:>3} {o.pp:>3} {o.zero:>4} {o.microbatches:>4} {o.micro_batch:>2} "
                     f"{o.memory_bytes / 1e9:>7.1f} {o.bubble:>6.3f} {o.comm_s['tp']:>6.2f} {o.comm_s['pp']:>6.2f} "
                     f"{o.comm_s['dp']:>6.2f} {o.step_s:>7.2f} {o.mfu:>5.2f} {o.hfu:>5.2f} {o.tflops_per_gpu:>6.0f}"
                     + "".join(f"  {k}={getattr(o, k)} ({k}_s {o.comm_s[k]:.2f})" for k in ("cp", "ep")
                               if getattr(o, k) > 1))
    if not p.fits:
        lines.append("   (no layout fits: more GPUs, a bigger GPU, or a smaller batch / sequence)")
    lines.append(format_assumption(r))
    lines.append(f"{len(p.fits)} layout(s) fit, {len(p.too_big)} exceed {r.capacity_bytes / 1e9:.0f} GB, "
                 f"{len(p.rejected)} rejected:")
    for o in p.too_big[:3]:  # the fastest that do not fit, and which term fills the GPU
        lines.append(f"  {o.layout} (micro-batch {o.micro_batch}) does not fit: {o.overflow}")
    for dp, tp, pp, reason in p.rejected[:8]:
        lines.append(f"  dp={dp} tp={tp} pp={pp}: {reason}")
    if len(p.rejected) > 8:
        lines.append(f"  ... and {len(p.rejected) - 8} more (--json lists all)")
    return "\n".join(lines)


def format_assumption(req: PlanRequest) -> str:
    e, a = req.efficiency, assumption(req)
    precision = hardware.default_precision(req.gpu) if req.precision == "bf16" else req.precision
    stack = hardware.stack_efficiency(req.gpu, req.stack)
    return (f"assumes {precision} matmuls at {e.value:.0%} of the {a['peak_tflops']:.0f} TFLOPS peak "
            f"({e.source}) plus their HBM traffic"
            + (f", x {stack:.2f} for the {req.stack} stack" if req.stack != "megatron" else "")
            + (f", {req.attention} attention at {a['attention_efficiency']:.0%}" if req.flash else
               ", unfused attention")
            + f"; NCCL at {a['comm_efficiency']:.0%} of NVLink and {a['network_efficiency']:.0%} of "
            f"{a['inter_node_gbps']:g} Gb/s per GPU between nodes (Megatron-Core's ZeRO-1/2 and torch FSDP's rings "
            f"striped over their members' NICs); checkpointing {req.checkpointing}"
            + ("" if req.sequence_parallel else ", no sequence parallelism")
            + (f", interleave {req.interleave}" if req.interleave > 1 else "")
            + (", TP overlapped" if req.tp_overlap else "")
            + (f", Adam moments in {req.optimizer_states}" if req.optimizer_states != "fp32" else ""))
