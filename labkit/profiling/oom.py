"""The OOM playbook: pull the memory levers in the taught order until the configuration fits.

"Profile first; then mixed precision; then activation checkpointing; then gradient accumulation; then
offload or quantize." `playbook(cfg, capacity)` starts from a `labkit.memory.MemoryConfig` that does not
fit, names its largest part (the profile), then adds one lever at a time, keeping each one, and stops at
the first that fits. Every step is estimated on the real model (`labkit.memory.estimate`) and the same
lever is measured on the smoke model (tiny-llama, real tensors on this machine) on the part it acts on:
the peak of one step (precision, checkpointing, accumulation, LoRA), the optimizer state (8-bit AdamW,
Dettmers et al. 2022) or the weights (NF4, Dettmers et al. 2023). Sharding and offload need several
ranks or a GPU, so they are estimated only (notebooks 04 and 05 measure them).

The levers after accumulation, cheapest in accuracy and speed first: shard the states over the data-
parallel GPUs (ZeRO-3 / FSDP, Rajbhandari et al. 2020), 8-bit optimizer states, offload the optimizer
(ZeRO-Offload, Ren et al. 2021), offload the parameters too (ZeRO-Infinity, Rajbhandari et al. 2021),
then change what trains: LoRA adapters (Hu et al. 2022) and an NF4 base (QLoRA). An offload that would
not fit in host RAM (`host_bytes`) is skipped, not kept. Introduced in notebook 08_profiling_and_stacking.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from labkit.errors import ConfigError
from labkit.memory.estimate import Estimate, MemoryConfig, estimate, spec_of
from labkit.memory.report import GPU_CAPACITIES

GB = 1e9
RTX_4090 = GPU_CAPACITIES["RTX 4090 24GB"]
PARTS = ("weights", "grads", "optimizer", "activations")


@dataclass(frozen=True)
class Lever:
    """One memory lever: the config change it makes (None = not applicable or already on)."""

    name: str
    change: Callable[[MemoryConfig], dict | None]
    measure: str
    """What the smoke measurement looks at: 'peak', 'optimizer', 'weights' or '' (estimated only)."""
    why: str


LEVERS = (
    Lever("mixed precision (bf16)", lambda c: dict(precision="mixed-bf16") if c.precision == "fp32" else None,
          "peak", "16-bit activations and gradients; fp32 master weights keep the update exact (Micikevicius 2018)"),
    Lever("activation checkpointing", lambda c: dict(checkpointing="full") if c.batch and c.checkpointing != "full"
          else None, "peak", "keep block inputs only, recompute the rest in backward (Chen et al. 2016)"),
    Lever("gradient accumulation (micro-batch 1)", lambda c: dict(grad_accum=c.batch) if c.batch and
          c.batch // c.grad_accum > 1 else None, "peak", "same global batch, activations of one sample"),
    Lever("shard over the GPUs (FSDP full_shard / ZeRO-3)", lambda c: dict(zero=3) if c.dp > 1 and c.zero < 3
          else None, "", "each of N GPUs keeps 1/N of weights, grads and optimizer states"),
    Lever("8-bit AdamW (bitsandbytes)", lambda c: dict(optimizer="adamw-8bit") if c.optimizer == "adamw" else None,
          "optimizer", "block-wise quantized moments: 2 B instead of 8 B per parameter"),
    Lever("offload optimizer to CPU (ZeRO-Offload)", lambda c: dict(offload="optimizer", zero=max(c.zero, 1))
          if c.offload == "none" else None, "", "optimizer states and the update live in host RAM"),
    Lever("offload parameters too (ZeRO-Infinity)", lambda c: dict(offload="optimizer+params", zero=3)
          if c.offload != "optimizer+params" else None, "", "the GPU holds one gathered layer at a time"),
    Lever("LoRA adapters r=8 (freeze the base)", lambda c: dict(lora_rank=8, lora_targets=("q_proj", "v_proj"))
          if not c.lora_rank else None, "peak", "train 2 small matrices per attention projection"),
    Lever("NF4 base (QLoRA)", lambda c: dict(quant="nf4-dq") if c.lora_rank and c.quant == "none" else None,
          "weights", "the frozen base in 4-bit NormalFloat with double quantization"),
)


@dataclass(frozen=True)
class Move:
    """One lever tried: its status, the config after it, the estimate and the smoke measurement."""

    lever: str
    status: str
    """'kept' (applied and kept), 'skipped' (needs more host RAM than there is) or 'n/a'."""
    config: MemoryConfig
    estimate: Estimate | None
    fits: bool
    measured: dict | None = None
    """{'what', 'before', 'after'} bytes on the smoke model, or {'note'} when not measurable here."""
    note: str = ""


@dataclass(frozen=True)
class Playbook:
    """The path taken from `start` to the first configuration that fits (or to the end of the levers)."""

    title: str
    capacity: float
    host_bytes: float | None
    start: Estimate
    moves: tuple

    @property
    def fits(self) -> bool:
        return self.start.fits(self.capacity) or any(m.fits for m in self.moves)

    @property
    def path(self) -> list[str]:
        return [m.lever for m in self.moves if m.status == "kept"]

    @property
    def final(self) -> Estimate:
        kept = [m for m in self.moves if m.status == "kept"]
        return kept[-1].estimate if kept else self.start

    @property
    def largest_part(self) -> str:
        return max(PARTS, key=lambda p: getattr(self.start, p))

    @property
    def text(self) -> str:
        s, cap = self.start, self.capacity
        host = f", {self.host_bytes / GB:.0f} GB host RAM" if self.host_bytes else ""
        lines = [f"OOM playbook: {self.title} ({cap / GB:.1f} GB per GPU{host})",
                 f"  start: {s.total / GB:.1f} GB = " + " + ".join(f"{p} {getattr(s, p) / GB:.1f}" for p in PARTS)
                 + (" -> fits" if s.fits(cap) else " -> does not fit"),
                 f"  profile first: the largest part is {self.largest_part} "
                 f"({100 * getattr(s, self.largest_part) / s.total:.0f} % of the total)"]
        for i, m in enumerate((m for m in self.moves if m.status != "n/a"), 1):
            est = m.estimate
            what = f"{est.total / GB:6.1f} GB" + (f", host {est.cpu_bytes / GB:.0f} GB" if est.cpu_bytes else "")
            verdict = "FITS" if m.fits else ("skipped: " + m.note if m.status == "skipped" else "does not fit")
            lines.append(f"  {i}. + {m.lever:<46} -> {what:<22} {verdict}")
            if m.measured:
                lines.append(f"       measured on tiny-llama: {_measured_text(m.measured)}")
        lines.append("path: " + (" -> ".join(self.path) or "(none)") +
                     (f"  => {self.final.total / GB:.1f} GB fits" if self.fits else "  => still does not fit: "
                      "add GPUs (tensor / pipeline parallelism) or shorten sequences"))
        return "\n".join(lines)


def _measured_text(m: dict) -> str:
    if "note" in m:
        return m["note"]
    return (f"{m['what']} {m['before'] / 2**20:.2f} MiB -> {m['after'] / 2**20:.2f} MiB "
            f"(x{m['after'] / m['before']:.2f})")


def playbook(cfg: MemoryConfig, capacity_bytes: float, *, host_bytes: float | None = None, title: str = "",
             measure: bool = True) -> Playbook:
    """Apply LEVERS in order on top of each other until `cfg` fits in `capacity_bytes` per GPU."""
    start = estimate(cfg)
    moves: list[Move] = []
    current, smoke, fits = cfg, smoke_config(cfg), start.fits(capacity_bytes)
    for lever in LEVERS:
        if fits:
            break
        change = lever.change(current)
        if change is None:
            moves.append(Move(lever.name, "n/a", current, None, False))
            continue
        try:
            new = current.replace(**change)
            est = estimate(new)
        except ConfigError as exc:  # e.g. LoRA on a ResNet: not a lever for this model
            moves.append(Move(lever.name, "n/a", current, None, False, note=str(exc)))
            continue
        if host_bytes is not None and est.cpu_bytes > host_bytes:
            moves.append(Move(lever.name, "skipped", new, est, False,
                              note=f"needs {est.cpu_bytes / GB:.0f} GB of host RAM > {host_bytes / GB:.0f} GB"))
            continue
        fits = est.fits(capacity_bytes)
        measured, smoke = _measure_lever(lever, smoke) if measure else (None, smoke)
        moves.append(Move(lever.name, "kept", new, est, fits, measured))
        current = new
    return Playbook(title or str(cfg.model), capacity_bytes, host_bytes, start, tuple(moves))


# ---------------------------------------------------------------------------- smoke measurements
def smoke_config(cfg: MemoryConfig) -> MemoryConfig:
    """The same training setup on the smoke model, one process: what this machine can measure."""
    vision = spec_of(cfg).kind == "vision"
    return MemoryConfig(model="tiny-resnet" if vision else "tiny-llama", precision=cfg.precision,
                        optimizer=cfg.optimizer, batch=16 if vision else 8, seq=None if vision else 32,
                        checkpointing=cfg.checkpointing, lora_rank=cfg.lora_rank, lora_targets=cfg.lora_targets,
                        quant=cfg.quant)


def _measure_lever(lever: Lever, smoke: MemoryConfig) -> tuple[dict | None, MemoryConfig]:
    """(measurement, smoke config after the lever)."""
    change = lever.change(smoke)
    if not lever.measure or change is None:
        why = "needs several ranks or a GPU: estimated only (notebooks 04 / 05 measure it)"
        return ({"note": why} if not lever.measure else None), smoke
    after = smoke.replace(**change)
    if lever.measure == "optimizer":
        return {"what": "optimizer state", "before": optimizer_state_bytes("adamw"),
                "after": optimizer_state_bytes(after.optimizer)}, after
    if lever.measure == "weights":
        return {"what": "weights", **nf4_weight_bytes()}, after
    return {"what": "peak of one step", "before": peak_bytes(_traceable(smoke)),
            "after": peak_bytes(_traceable(after))}, after


def _traceable(cfg: MemoryConfig) -> MemoryConfig:
    """What `labkit.memory.measure` can run: 32-bit AdamW states and a bf16 base stand in for 8-bit / NF4."""
    return cfg.replace(optimizer="adamw" if cfg.optimizer != "sgd" else cfg.optimizer, quant="none")


@functools.lru_cache(maxsize=32)
def peak_bytes(cfg: MemoryConfig) -> int:
    """Peak bytes of one real training step of `cfg` on this machine (labkit.memory.measure)."""
    from labkit.memory.measure import measure
    return int(measure(cfg, device="cpu").total)


@functools.lru_cache(maxsize=8)
def optimizer_state_bytes(name: str, model: str = "tiny-llama") -> int:
    """Optimizer state after one real step of a full fine-tune of `model` (labkit.optim names)."""
    import torch

    from labkit.zoo.models import build_llm
    from labkit.optim import build_optimizer
    from labkit.train.metrics import tensor_bytes

    net = build_llm(model, seed=0)
    opt = build_optimizer(name, net.parameters(), 1e-3)
    ids = torch.randint(0, net.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    net(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(tensor_bytes(states, torch.device("cpu")))


@functools.lru_cache(maxsize=2)
def nf4_weight_bytes(model: str = "tiny-llama") -> dict:
    """{'before': bf16 bytes, 'after': NF4 bytes incl. quantization constants} of `model`'s weights."""
    import tempfile

    from labkit.zoo.models import save_llm
    from labkit.parallel.qlora import load_4bit, weight_bytes

    with tempfile.TemporaryDirectory(prefix="labkit-nf4-") as tmp:
        wb = weight_bytes(load_4bit(save_llm(model, tmp)))
    return {"before": wb["bf16_equivalent"], "after": wb["total"]}


# ---------------------------------------------------------------------------- the seed's scenarios
#: Llama-2-70B (Touvron et al. 2023, published config.json): not a labkit preset, so a config file.
LLAMA2_70B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=8192,
                  intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)


def llama2_70b_config(folder) -> str:
    """Write Llama-2-70B's config.json into `folder` (the estimator reads configs); returns the folder."""
    import json
    from pathlib import Path

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA2_70B), encoding="utf-8")
    return str(path)


def scenarios(folder) -> dict[str, tuple[MemoryConfig, float, float, str]]:
    """The course's OOM scenarios: name -> (config, GPU bytes, host bytes, title). Host RAM is an assumption."""
    return {
        "7b-on-4090": (MemoryConfig(model="llama2-7b", precision="fp32", batch=4, seq=2048), RTX_4090, 64 * GB,
                       "Llama-2-7B full fine-tune (~112 GB of weights, grads and Adam states), one 24 GB RTX 4090"),
        "70b-on-2x24": (MemoryConfig(model=llama2_70b_config(folder), precision="mixed-bf16", dp=2, gpus=2,
                                     batch=1, seq=2048), RTX_4090, 128 * GB,
                        "Llama-2-70B fine-tune on two 24 GB RTX 4090s (Answer.AI 2024, FSDP + QLoRA; "
                        "talk 'Slaying OOMs with PyTorch FSDP and torchao', Saroufim & Xu 2024)"),
    }


def ddp_vs_fsdp(model: str, dp: int, seq: int, *, batch: int = 1) -> dict[str, Estimate]:
    """Per-GPU estimates of DDP and FSDP FULL_SHARD for `model` on `dp` GPUs (mixed bf16, full
    checkpointing, `batch` x `seq` per GPU): notebook 04's "DDP runs out of memory where FSDP fits"."""
    common = dict(model=model, dp=dp, batch=batch, seq=seq, checkpointing="full")
    return {"ddp": estimate(MemoryConfig(**common)), "fsdp": estimate(MemoryConfig.for_fsdp("full_shard", **common))}
