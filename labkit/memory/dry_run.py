"""Trace one real training step under `FakeTensorMode` with torch's `MemTracker`.

The actual model (the same `labkit.zoo.models` builders the labs train) runs forward, backward and an
optimizer step on fake tensors: every op computes shapes and dtypes but allocates nothing, so a
Llama-2-7B full fine-tune step is traced on a CPU machine. `MemTracker` attributes every storage to
parameters, buffers, gradients, activations, temporaries or optimizer states.

What we report (the `Estimate` layout, `source='trace'`):
- weights = parameters + buffers, grads, optimizer = states (+ fp32 master copies in the mixed
  modes) — each read after the optimizer step;
- activations = the largest amount of forward-pass memory alive at any point of the step (the
  saved tensors plus the loss's transients, and the recomputed layer under checkpointing);
- total = the observed peak of everything together, temporaries included.

Mixed precision is traced the ZeRO way (Rajbhandari et al. 2020, Sec. 3.1): a bf16/fp16 model
with fp32 master weights owned by the optimizer, updated one parameter at a time so no full fp32
gradient copy exists. Introduced in notebook 01_memory.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

from labkit.errors import ConfigError
from labkit.memory.estimate import Estimate, MemoryConfig, lora_targets, spec_of

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "mixed-bf16": torch.bfloat16, "mixed-fp16": torch.float16}
TRACEABLE_OPTIMIZERS = ("adamw", "sgd", "sgd-momentum")


class PeakTracker(MemTracker):
    """MemTracker that keeps device-level peaks only: the total and each category's own maximum.

    torch's version also updates a peak for every active module after every op (O(ops x modules)),
    which we do not use and which makes a 7B step take minutes instead of seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.category_peaks: dict[str, int] = {}

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            total = snap.get(_TOTAL_KEY, 0)
            if self._peak_mem.get(dev, 0) < total:
                self._peak_mem[dev] = total
                self._peak_mem_snap[dev] = dict(snap)
            for key, value in snap.items():
                name = getattr(key, "name", str(key))
                if value > self.category_peaks.get(name, 0):
                    self.category_peaks[name] = value

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        # torch's MemTracker hooks every parameter's gradient, which raises for frozen ones (a LoRA
        # base): mark those as already hooked. They never get a gradient to track.
        for p in module.parameters():
            if not p.requires_grad and p not in self._param_to_grad_hook_handles:
                self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


class _NoHook:
    def remove(self) -> None:
        pass


def check_traceable(cfg: MemoryConfig) -> None:
    """ConfigError unless one device's step of `cfg` can be run (trace and CPU measure)."""
    spec = spec_of(cfg)
    if spec.kind not in ("llm", "vision") or cfg.model is None:
        raise ConfigError(f"cannot build {spec.name!r} as a torch model: trace/measure run Llama presets, "
                          "ResNet presets or a Llama config.json (use `estimate` for the others)")
    problems = [f"{k}={getattr(cfg, k)}" for k in ("dp", "tp", "pp", "cp", "ep") if getattr(cfg, k) != 1]
    problems += [f"{k}={getattr(cfg, k)!r}" for k, ok in (("offload", "none"), ("quant", "none"))
                 if getattr(cfg, k) != ok]
    if cfg.zero and cfg.dp > 1:
        problems.append(f"zero={cfg.zero}")
    if problems:
        raise ConfigError(f"trace/measure run one device without sharding, offload or quantization; "
                          f"drop {', '.join(problems)} (measure sharded runs with the FSDP/ZeRO labs)")
    if cfg.optimizer not in TRACEABLE_OPTIMIZERS:
        raise ConfigError(f"optimizer {cfg.optimizer!r} cannot run on fake tensors; trace one of "
                          f"{', '.join(TRACEABLE_OPTIMIZERS)} and compare the estimate for 8-bit states")
    if cfg.checkpointing == "selective":
        raise ConfigError("selective checkpointing has no Hugging Face switch; trace 'none' or 'full'")
    if spec.kind == "vision" and (cfg.checkpointing != "none" or cfg.lora_rank):
        raise ConfigError("ResNet steps are traced without checkpointing or LoRA")


def build(cfg: MemoryConfig, *, device: str = "cpu", fake_mode=None):
    """(model, trainable params, inputs, labels) for one step of `cfg`.

    With `fake_mode`, the model (and its LoRA adapters) is built on the meta device and its
    parameters are then replaced by fake CPU tensors: fake parameters cannot be converted with
    `.to()` (torch swaps them, which their weak references forbid), meta ones can."""
    from labkit.runtime import rehearsal

    spec = spec_of(cfg)
    dtype = _DTYPES[cfg.precision]
    batch = (cfg.batch or 1) // cfg.grad_accum
    # Built in host memory (fp32 init), cast there, then moved: the device never holds the transient
    # fp32 copy of a bf16/fp16 model (7B: 28 GB), which would both inflate a measured peak and OOM
    # under a memory cap before the step starts.
    with torch.device("meta" if fake_mode is not None else "cpu"):
        model = _build_model(cfg.model).to(dtype)
        model.train()
        if spec.kind == "llm":
            model = _prepare_llm(model, cfg, spec)
    if fake_mode is None and torch.device(device).type != "cpu":
        model.to(device)
    inputs = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with inputs:
        if fake_mode is not None:
            _materialize(model)
        small = rehearsal.active()  # a rehearsal's stand-in model: its vocabulary, short inputs
        if spec.kind == "vision":
            side, classes = spec.arch["image_size"], spec.arch["num_classes"]
            side = min(side, rehearsal.IMAGE_SIZE) if small else side
            x = torch.randn(batch, 3, side, side, dtype=dtype, device=device)
            y = torch.randint(0, classes, (batch,), device=device)
        else:
            seq = cfg.seq or min(spec.arch["max_seq"], 2048)
            seq = min(seq, rehearsal.SEQ_LEN) if small else seq
            vocab = model.config.vocab_size if small else spec.arch["vocab"]
            x = y = torch.randint(0, vocab, (batch, seq), device=device)
    return model, [p for p in model.parameters() if p.requires_grad], x, y


def _build_model(name: str):
    """A preset through `labkit.zoo.models` (what the labs train), or a model from a config.json's
    architecture (random weights: a checkpoint's weights are never needed to count bytes)."""
    from labkit.zoo import presets
    from labkit.zoo.models import build_model, llm_config

    if name in presets.ALL_MODELS:
        return build_model(name)
    from transformers import AutoModelForCausalLM

    from labkit.zoo import hub

    folder = Path(name).parent if Path(name).is_file() else Path(name)
    # a HF id: llm_config reads the cached config.json (labkit.zoo.hub); weights are never loaded here
    return AutoModelForCausalLM.from_config(llm_config(name if hub.is_hub_id(name) else str(folder)))


def _prepare_llm(model, cfg: MemoryConfig, spec):
    model.set_attn_implementation("sdpa" if cfg.flash_attention else "eager")
    if cfg.checkpointing == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora_rank:
        from peft import LoraConfig, get_peft_model

        lcfg = LoraConfig(r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank, lora_dropout=0.0,
                          target_modules=list(lora_targets(spec, cfg)))
        model = get_peft_model(model, lcfg, autocast_adapter_dtype=False)
        model.to(next(model.parameters()).dtype)  # on meta, peft leaves the adapters in fp32
    return model


def _materialize(model) -> None:
    """Replace every meta parameter / buffer by an (active fake mode) CPU tensor; shared stay shared."""
    new: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in new:
                    fresh = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                    is_param = isinstance(t, torch.nn.Parameter)
                    new[id(t)] = torch.nn.Parameter(fresh, requires_grad=t.requires_grad) if is_param else fresh
                table[name] = new[id(t)]


def _optimizer(cfg: MemoryConfig, params: list):
    # foreach=False: per-parameter kernels, so no model-sized temporaries inflate the peak
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=False)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if cfg.optimizer == "sgd-momentum" else 0.0,
                           foreach=False)


def _loss(model, x, y, kind: str):
    if kind == "vision":
        return torch.nn.functional.cross_entropy(model(x), y)
    return model(input_ids=x, labels=y).loss  # drop the logits: only the loss's graph stays alive


def run_step(cfg: MemoryConfig, *, device: str = "cpu", fake_mode=None, tracker_cls=None,
             on_built=None) -> tuple[dict, dict, int, int]:
    """Build and run one forward/backward/step under a MemTracker.

    `on_built()` is called once the model is built, cast to its training dtype and on `device`, and
    before anything of the step exists (master copies, optimizer, activations): `measure` resets the
    CUDA allocator's peak there. Returns (bytes by category after the step, category peaks,
    parameter count, trainable count)."""
    model, trainable, x, y = build(cfg, device=device, fake_mode=fake_mode)
    if on_built is not None:
        on_built()
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        master = cfg.precision.startswith("mixed")
        masters = [p.detach().float() for p in trainable] if master else []
        opt = _optimizer(cfg, masters if master else trainable)
        tracker = (tracker_cls or PeakTracker)()
        tracker.track_external(model, opt, *masters)  # masters are counted as 'Other' = optimizer
        kind = spec_of(cfg).kind
        with tracker:
            for i in range(cfg.grad_accum):  # micro-batches accumulate into the same .grad tensors
                if i:
                    tracker.reset_mod_stats()  # MemTracker keeps per-module stats for one iteration
                _loss(model, x, y, kind).backward()
            if master:
                _master_step(opt, trainable, masters)
            else:
                opt.step()
    current, peak = (_by_name(tracker.get_tracker_snapshot(kind)) for kind in ("current", "peak"))
    peaks = {**getattr(tracker, "category_peaks", {}), "Total": peak.get("Total", 0)}
    n = sum(p.numel() for p in model.parameters())
    return current, peaks, n, sum(p.numel() for p in trainable)


def _by_name(snapshot: dict) -> dict:
    """{category name: bytes} of a one-device MemTracker snapshot."""
    snap = next(iter(snapshot.values()), {})
    return {getattr(k, "name", str(k)): v for k, v in snap.items()}


def _master_step(opt, params: list, masters: list) -> None:
    """ZeRO-style mixed-precision update: fp32 grad of ONE parameter at a time, step, copy back."""
    current: list = []

    def cast_grad(_opt, _args, _kwargs) -> None:
        # inside step(), so MemTracker files this transient fp32 gradient as optimizer memory
        p, m = current[0]
        m.grad = p.grad.float()

    handle = opt.register_step_pre_hook(cast_grad)
    try:
        for p, m in zip(params, masters):
            if p.grad is None:
                continue
            current[:] = [(p, m)]
            opt.step()  # AdamW skips parameters whose .grad is None: only `m` moves
            m.grad = None
            with torch.no_grad():
                p.copy_(m)
    finally:
        handle.remove()


def to_estimate(cfg: MemoryConfig, current: dict, peaks: dict, n: int, trainable: int,
                source: str, notes: list) -> Estimate:
    weights = current.get("PARAM", 0) + current.get("BUFFER", 0)
    optimizer = current.get("OPT", 0) + current.get("OTH", 0)
    return Estimate(params=n, trainable_params=trainable, weights=weights, grads=current.get("GRAD", 0),
                    optimizer=optimizer, activations=peaks.get("ACT", 0), total=peaks.get("Total", 0),
                    cpu_bytes=0, assumptions=tuple(notes), source=source)


def trace(cfg: MemoryConfig) -> Estimate:
    """One training step of `cfg` on fake tensors; nothing is allocated."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    check_traceable(cfg)
    if spec_of(cfg).expert_params:
        raise ConfigError(f"{cfg.model} routes tokens to experts by value (data-dependent shapes), which "
                          "fake tensors cannot run; measure one real step instead: `labkit memory measure`")
    start = time.perf_counter()
    with _quiet():
        current, peaks, n, trainable = run_step(cfg, fake_mode=FakeTensorMode())
    notes = [f"traced one step of {cfg.model} under FakeTensorMode + MemTracker in "
             f"{time.perf_counter() - start:.1f} s (nothing allocated)",
             "weights/grads/optimizer read after the step; activations = largest forward memory alive; "
             "total = observed peak incl. temporaries"]
    return to_estimate(cfg, current, peaks, n, trainable, "trace", notes)


@contextlib.contextmanager
def _quiet():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
