"""Activation memory: the tensors autograd keeps from the forward pass for the backward pass.

Pure Python, no torch. The numbers are the peak bytes of saved activations on one GPU during one
training step, for the tensors that *our* models really save (checked against `labkit.memory.dry_run`):

- Llama (HF `LlamaForCausalLM`): counted tensor by tensor from the modelling code — RMSNorm keeps an
  fp32 copy of its input (HF upcasts), SwiGLU keeps 4 intermediates of width `intermediate_size`,
  SDPA/flash attention keeps q, k, v, its output and a log-sum-exp (Dao et al. 2022, Sec. 3.1),
  eager attention keeps the (b, a, s, s) softmax in fp32 and in the compute dtype. Frozen layers
  (LoRA) save less: a linear whose weight needs no gradient does not keep its input.
- GPT-3 style blocks: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", Sec. 4 / Table 2: s*b*h*(34 + 5*a*s/h) bytes per layer at 16 bits, of which
  10*s*b*h stay replicated under tensor parallelism unless sequence parallelism splits them too.
- ResNet (torchvision, in-place ReLU): every conv keeps its input, every BatchNorm its input.

Schedules follow Korthikanti et al. 2022 Sec. 4.2.3: with 1F1B pipelining (Narayanan et al. 2021)
the first stage holds min(pp, micro-batches) micro-batches of its L/pp layers in flight, the last
stage one micro-batch plus the LM head; we report the larger. Full checkpointing (Chen et al. 2016)
keeps each layer's input and recomputes one layer at a time in the backward pass; selective
checkpointing (Korthikanti Sec. 5) drops only the quadratic attention core.
Introduced in notebook 01_memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.parallel import comm

FP32 = 4


@dataclass(frozen=True)
class Step:
    """What shapes the activations of one training step on one GPU."""

    micro_batch: int
    seq: int
    act_bytes: int
    """Bytes per activation element: 4 in fp32, 2 in bf16/fp16 and the mixed modes."""
    checkpointing: str = "none"
    flash: bool = True
    tp: int = 1
    sp: bool = False
    pp: int = 1
    n_micro: int = 1
    """Micro-batches per optimizer step (gradient-accumulation steps)."""
    lora_targets: frozenset = frozenset()
    lora_rank: int = 0
    """0 = full fine-tune (every weight trainable); > 0 = LoRA on a frozen base."""
    fused_loss: bool = False
    """A fused cross-entropy (flash-attn's, Liger's, Megatron-Core's loss fusion) keeps only the logits in the
    compute dtype and writes their gradient in place: no fp32 copy, no fp32 log-probabilities."""
    fused: bool = False
    """Fused RMSNorm / SwiGLU kernels (Megatron-LM, Meta, Transformer Engine) instead of HF's eager modules:
    the norm keeps its bf16 input and an fp32 rstd (no fp32 copy, no normalised copy), SwiGLU its input
    (gate, up) and output (the down projection's input), not silu(gate)."""


@dataclass(frozen=True)
class Layer:
    """Saved bytes of one transformer layer, split by how tensor parallelism divides them."""

    replicated: int
    """Norm-region tensors: split by tp only under sequence parallelism."""
    sharded: int
    """Head- and MLP-width tensors: split by tp."""
    core: int
    """The quadratic attention core (eager only): split by tp, dropped by selective checkpointing."""

    def stored(self, st: Step) -> float:
        rep = self.replicated / st.tp if st.sp else self.replicated
        return rep + (self.sharded + self.core) / st.tp


def _saves(st: Step, *names: str) -> bool:
    """Whether a frozen-or-not linear keeps its input: full fine-tune, or a LoRA target."""
    return st.lora_rank == 0 or any(n in st.lora_targets for n in names)


def llama_layer(arch: dict, st: Step) -> Layer:
    """Bytes HF's LlamaDecoderLayer saves for backward (tokens T = b*s, hidden h)."""
    t, e = st.micro_batch * st.seq, st.act_bytes
    h, inter, a, kv, hd = (arch[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim"))
    full = st.lora_rank == 0
    # RMSNorm x2: fp32 input copy (x.to(float32), kept by pow) + rsqrt (T) + normalised x (kept by
    # the weight multiply only if the weight trains) + the output, kept by the next linear(s).
    norm = 2 * (FP32 * t * h + FP32 * t + (e * t * h if full else 0)) if not st.fused else 2 * (e * t * h + FP32 * t)
    norm += e * t * h * (_saves(st, "q_proj", "k_proj", "v_proj") + _saves(st, "gate_proj", "up_proj"))
    if st.flash:  # q, k, v at their own head counts, output (shared with o_proj's input), lse fp32
        attn = e * t * (a * hd + 2 * kv * hd) + e * t * a * hd + FP32 * t * a
        core = 0
    else:  # q and repeat_kv'd k, v; softmax in fp32 (+ its cast); contiguous output for o_proj
        attn = 3 * e * t * a * hd + (e * t * a * hd if _saves(st, "o_proj") else 0)
        core = st.micro_batch * a * st.seq**2 * (FP32 + (e if e != FP32 else 0))
    mlp = (2 if st.fused else 3) * e * t * inter + (e * t * inter if _saves(st, "down_proj") else 0)  # gate, silu, up, gate*up
    if arch.get("experts"):  # MoE (Mixtral): each token's k expert copies keep their input, the SwiGLU
        # four and the weighted output; router logits, probabilities, top-k scores in fp32 (checked
        # against a real step, labkit.memory.measure; fake tensors cannot route)
        mlp = arch["top_k"] * e * t * (4 * inter + 2 * h) + 3 * FP32 * t * arch["experts"]
    lora = len(st.lora_targets) * e * t * st.lora_rank  # lora_A output, kept by lora_B
    if st.fused and st.flash and not arch.get("experts"):
        # Op-level selective recomputation (torchtitan's "op" policy, Megatron's fused kernels): keep the GEMM
        # and attention outputs, recompute the cheap elementwise ones -- the two norm outputs and SwiGLU's
        # product -- so `core` (what selective drops) is those; flash never stores the s x s scores anyway.
        outputs = e * t * h * (_saves(st, "q_proj", "k_proj", "v_proj") + _saves(st, "gate_proj", "up_proj"))
        product = e * t * inter if _saves(st, "down_proj") else 0
        return Layer(replicated=norm - outputs, sharded=attn + mlp - product + lora, core=outputs + product)
    return Layer(replicated=norm, sharded=attn + mlp + lora, core=core)


def gpt_layer(arch: dict, st: Step) -> Layer:
    """Korthikanti et al. 2022, Table 2: 10sbh replicated + 24sbh sharded + 5as^2b core (16-bit)."""
    t, h, a = st.micro_batch * st.seq, arch["hidden"], arch["heads"]
    scale = st.act_bytes / 2  # the paper counts 16-bit activations
    core = 0 if st.flash else 5 * a * st.seq**2 * st.micro_batch
    sharded = 24 * t * h + (FP32 * t * a / scale if st.flash else 0)  # flash keeps a fp32 lse instead
    lora = len(st.lora_targets) * 2 * t * st.lora_rank
    return Layer(replicated=int(10 * t * h * scale), sharded=int((sharded + lora) * scale), core=int(core * scale))


def _head(arch: dict, st: Step, gpt: bool) -> tuple[float, float, float]:
    """(final norm, shared rotary tables, loss transient) bytes; the LM head is vocab-parallel under tp.

    HF's loss upcasts the logits to fp32 and log_softmax keeps an fp32 output, so at the loss the
    logits exist up to three times: in the compute dtype, in fp32, and as log-probabilities."""
    t, e, h, vocab = st.micro_batch * st.seq, st.act_bytes, arch["hidden"], arch["vocab"]
    full = st.lora_rank == 0
    norm = (2 * e * t * h) if gpt else (FP32 * t * h + FP32 * t + (2 * e * t * h if full else 0))
    logits = t * vocab * (e if st.fused_loss else e + (FP32 if e != FP32 else 0) + FP32)
    rope = 0 if gpt else 2 * st.micro_batch * st.seq * arch["head_dim"] * e  # cos, sin shared by layers
    return (norm / st.tp if st.sp else norm), rope, logits / st.tp


def transformer_bytes(arch: dict, st: Step, *, gpt: bool = False) -> int:
    """Peak activation bytes on the busiest pipeline stage of one GPU: the larger of the forward
    peak (everything kept + the loss's transients) and the backward peak (everything kept + the
    layer being recomputed, once the head's tensors are freed)."""
    layer = (gpt_layer if gpt else llama_layer)(arch, st)
    per_layer = layer.stored(st)
    if st.checkpointing == "full":  # keep each layer's input, recompute one layer in backward
        kept = st.micro_batch * st.seq * arch["hidden"] * st.act_bytes / (st.tp if st.sp else 1)
        working = per_layer
    elif st.checkpointing == "selective":  # drop the attention core, recompute it per layer
        kept, working = per_layer - layer.core / st.tp, layer.core / st.tp
    else:
        kept, working = per_layer, 0.0
    layers = math.ceil(arch["layers"] / st.pp)
    norm, rope, transient = _head(arch, st, gpt)
    in_flight = comm.in_flight("1f1b", st.pp, st.n_micro)  # 1F1B: the first stage holds up to pp micro-batches
    first = layers * kept * in_flight + rope + (norm + transient if st.pp == 1 else 0)
    last = layers * kept + rope + norm + transient
    backward = layers * kept * in_flight + rope + working
    return int(math.ceil(max(first, last, backward)))


def resnet_bytes(arch: dict, micro_batch: int, act_bytes: int) -> int:
    """torchvision ResNet with Bottleneck blocks and in-place ReLU, one micro-batch.

    Per conv+BN(+ReLU): the conv output (kept by BN) and, where a ReLU follows, the BN output
    (kept by the in-place ReLU and the next conv). The stem's max-pool keeps int64 indices."""
    e, side = act_bytes, arch["image_size"]
    s = math.ceil(side / 2)
    elems = 2 * 64 * s * s  # stem conv1 out + relu(bn1) out
    s = math.ceil(s / 2)
    idx_bytes = 64 * s * s * 8
    elems += 64 * s * s  # max-pool output
    inplanes = 64
    for stage, (planes, count) in enumerate(zip((64, 128, 256, 512), arch["layers"])):
        for i in range(count):
            stride = 2 if (i == 0 and stage > 0) else 1
            out_s = math.ceil(s / stride)
            elems += 2 * planes * s * s + 2 * planes * out_s * out_s  # conv1, conv2 (+ bn/relu)
            elems += planes * 4 * out_s * out_s * 2  # conv3 output (bn3 input) + relu(add) output
            if i == 0 and (stage > 0 or inplanes != planes * 4):
                elems += planes * 4 * out_s * out_s  # downsample conv output
            s, inplanes = out_s, planes * 4
    classes = arch["num_classes"]
    head = e * (2048 + classes) + FP32 * classes
    return micro_batch * (e * elems + idx_bytes + head)
