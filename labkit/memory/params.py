"""Exact parameter counts of the course's models, from preset numbers alone (pure Python, no torch).

A `ModelSpec` is what the estimator needs to know about a model: how many parameters it has, where
they sit (embedding / one block / head, so pipeline stages and ZeRO-3 working sets can be sized),
which linear layers LoRA can target or bitsandbytes can quantize, and the architecture numbers the
activation formulas use. Counts are exact: `model_spec("llama2-7b").params == 6_738_415_616` and
`model_spec("resnet50").params == 25_557_032`, the numbers torch reports for the built models.
A path to a Hugging Face `config.json` (or its folder) is counted by building the model on torch's
meta device, which allocates nothing. Introduced in notebook 01_memory.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from labkit.zoo import presets
from labkit.errors import ConfigError


@dataclass(frozen=True)
class Linear:
    """One kind of linear layer inside a repeated block (LoRA target, bitsandbytes quantization)."""

    name: str
    """Module name as peft matches it, e.g. 'q_proj'."""
    fan_in: int
    fan_out: int
    count: int
    """How many of these the whole model has (one per block)."""
    bias: bool = False


@dataclass(frozen=True)
class ModelSpec:
    """Parameter layout of one model (all counts in elements, not bytes)."""

    name: str
    kind: str
    """'llm' (Llama family), 'gpt' (GPT-3 style block), 'vision' (ResNet) or 'params' (a bare count)."""
    params: int
    buffers: int = 0
    """Floating-point buffer elements (BatchNorm running stats), counted with the weights."""
    embed: int = 0
    """Parameters before the first block (token + position embeddings, or the ResNet stem)."""
    block: int = 0
    """Parameters of one repeated block (transformer layer)."""
    num_blocks: int = 0
    head: int = 0
    """Parameters after the last block (final norm + untied LM head, or the ResNet classifier)."""
    linears: tuple[Linear, ...] = ()
    arch: dict = field(default_factory=dict)
    """Architecture numbers for the activation formulas (hidden_size, heads, vocab, ...)."""
    expert_params: int = 0
    """Parameters of all mixture-of-experts experts (0 for a dense model): what expert parallelism splits."""

    @property
    def largest_layer(self) -> int:
        """Largest unit ZeRO-3 / FSDP gathers at once (a block, or the embedding / head)."""
        return max(self.block, self.embed, self.head, 1) if self.kind != "params" else self.params


#: Fused projections LoRA may also target slice by slice: fused name -> slice names (equal widths).
FUSED_SLICES = {"qkv": ("q_proj", "k_proj", "v_proj")}


def lora_units(spec: ModelSpec) -> dict[str, Linear]:
    """Every linear LoRA can target, by name. A fused projection (GPT-3's qkv) also offers its slices:
    the LoRA paper adapts Wq and Wv of GPT-3 175B separately (Hu et al. 2022, Sec. 7.1: r=4 on Wq, Wv
    of 96 layers = 96 x 2 x 4 x (12288 + 12288) = 18,874,368 = "18.9M")."""
    units = {lin.name: lin for lin in spec.linears}
    for lin in spec.linears:
        for name in FUSED_SLICES.get(lin.name, ()):
            units[name] = Linear(name, lin.fan_in, lin.fan_out // len(FUSED_SLICES[lin.name]), lin.count, lin.bias)
    return units


def llama_spec(name: str, cfg: dict) -> ModelSpec:
    """Exact count for an HF `LlamaForCausalLM` (no biases, RMSNorm weights only)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    vocab = cfg["vocab_size"]
    linears = (Linear("q_proj", h, heads * hd, layers), Linear("k_proj", h, kv * hd, layers),
               Linear("v_proj", h, kv * hd, layers), Linear("o_proj", heads * hd, h, layers),
               Linear("gate_proj", h, inter, layers), Linear("up_proj", h, inter, layers),
               Linear("down_proj", inter, h, layers))  # count = one per layer
    experts = cfg.get("num_local_experts", 0)
    if experts:  # Mixtral: E SwiGLU experts of width `inter` (stacked 3-D weights) + a router (E x h)
        linears = linears[:4]  # the experts are not nn.Linear modules (no LoRA / bnb targets)
    block = sum(lin.fan_in * lin.fan_out for lin in linears) + 2 * h  # + two RMSNorm weights
    block += experts * (3 * h * inter + h)
    embed = vocab * h
    head = h + (0 if cfg.get("tie_word_embeddings") else vocab * h)  # final norm (+ lm_head)
    arch = dict(hidden=h, intermediate=inter, layers=layers, heads=heads, kv_heads=kv, head_dim=hd,
                vocab=vocab, max_seq=cfg.get("max_position_embeddings", 2048),
                tied=bool(cfg.get("tie_word_embeddings")))
    if experts:
        arch.update(experts=experts, top_k=cfg.get("num_experts_per_tok", 2))
    # buffers: the rotary inv_freq and original_inv_freq (head_dim / 2 each)
    return ModelSpec(name, "llm", embed + layers * block + head, buffers=hd, embed=embed, block=block,
                     num_blocks=layers, head=head, linears=linears, arch=arch,
                     expert_params=layers * experts * 3 * h * inter)


def gpt_spec(name: str, cfg: dict) -> ModelSpec:
    """GPT-3 style block (Brown et al. 2020; Megatron layout): fused QKV, 4h GeLU MLP, biases,
    LayerNorms, learned positions, LM head tied to the token embedding. 12*L*h^2 + 13*L*h + ..."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    vocab, pos = cfg["vocab_size"], cfg["max_position_embeddings"]
    linears = (Linear("qkv", h, 3 * h, layers, True), Linear("proj", h, h, layers, True),
               Linear("fc1", h, inter, layers, True), Linear("fc2", inter, h, layers, True))
    block = sum((lin.fan_in + 1) * lin.fan_out for lin in linears) + 4 * h  # + 2 LayerNorms
    embed = (vocab + pos) * h
    head = 2 * h  # final LayerNorm; the head reuses the embedding
    arch = dict(hidden=h, intermediate=inter, layers=layers, heads=cfg["num_attention_heads"],
                kv_heads=cfg["num_attention_heads"], head_dim=h // cfg["num_attention_heads"],
                vocab=vocab, max_seq=pos, tied=True)
    return ModelSpec(name, "gpt", embed + layers * block + head, embed=embed, block=block,
                     num_blocks=layers, head=head, linears=linears, arch=arch)


def resnet_spec(name: str, cfg: dict) -> ModelSpec:
    """Exact count for torchvision's ResNet with Bottleneck blocks (He et al. 2016, Table 1).

    Each conv has no bias; each BatchNorm has 2*C parameters and 2*C floating buffers."""
    if cfg.get("block", "bottleneck") != "bottleneck":
        raise ConfigError(f"vision preset {name!r}: block={cfg['block']!r}; only 'bottleneck' is modelled")
    params = 3 * 64 * 7 * 7 + 2 * 64  # stem conv 7x7 + bn1
    buffers, inplanes, blocks, largest = 2 * 64, 64, 0, 0
    for stage, (planes, count) in enumerate(zip((64, 128, 256, 512), cfg["layers"])):
        for i in range(count):
            width, out = planes, planes * 4
            p = inplanes * width + 9 * width * width + width * out + 2 * (2 * width + out)
            bn = 2 * (2 * width + out)
            if i == 0 and (stage > 0 or inplanes != out):  # projection shortcut
                p += inplanes * out + 2 * out
                bn += 2 * out
            params, buffers, largest = params + p, buffers + bn, max(largest, p)
            inplanes, blocks = out, blocks + 1
    classes = cfg["num_classes"]
    head = 2048 * classes + classes
    arch = dict(layers=tuple(cfg["layers"]), num_classes=classes, image_size=cfg["image_size"])
    return ModelSpec(name, "vision", params + head, buffers=buffers, embed=3 * 64 * 49 + 128,
                     block=largest, num_blocks=blocks, head=head, arch=arch)


def params_spec(n: int) -> ModelSpec:
    """A bare parameter count (`--params N`): model states only, no architecture."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"params={n!r}; give a positive integer number of parameters, e.g. 7_000_000_000")
    return ModelSpec(f"{n} params", "params", n)


# ----------------------------------------------------------------------------- HF config families
# `labkit memory estimate --model` and `labkit plan --model` read a preset, an HF id in the local cache, a folder or
# a config.json; a config of a known family becomes the exact parameter layout in pure Python (no torch):
#   llama, mistral, qwen2, mixtral   gated SwiGLU MLP, RMSNorm, rotary; qwen2 adds q/k/v biases; mixtral's MLP is
#                                    E experts + a router (`llama_spec`)
#   gpt2, gpt_neox, bloom, opt,      GPT-style blocks: one attention (fused or separate q/k/v), a 4h (or ffn_dim)
#   falcon                           GeLU/ReLU MLP, LayerNorms with biases (Korthikanti et al.'s activation formula)
# Counts are exact: tests/test_planner_models.py builds each family on torch's meta device and compares.

LLAMA_LIKE = ("llama", "mistral", "qwen2", "mixtral")
GPT_LIKE = ("gpt2", "gpt_neox", "bloom", "opt", "falcon")
FAMILIES = LLAMA_LIKE + GPT_LIKE


def _get(cfg: dict, *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    if default is not None:
        return default
    raise ConfigError(f"config.json of a {cfg.get('model_type')} model has none of {keys}; is it complete?")


def family_spec(name: str, cfg: dict) -> ModelSpec:
    """The spec of an HF config dict whose `model_type` is one of FAMILIES."""
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        raise ConfigError(f"model_type {kind!r} is not modelled; known families: {', '.join(FAMILIES)}")
    if kind in LLAMA_LIKE:
        spec = llama_spec(name, cfg)
        if kind == "qwen2":  # q, k, v projections carry biases
            a = spec.arch
            bias = a["layers"] * (a["heads"] + 2 * a["kv_heads"]) * a["head_dim"]
            return ModelSpec(name, "llm", spec.params + bias, buffers=spec.buffers, embed=spec.embed,
                             block=spec.block + bias // a["layers"], num_blocks=spec.num_blocks, head=spec.head,
                             linears=spec.linears, arch=spec.arch, expert_params=spec.expert_params)
        return spec
    return _gpt_family(name, kind, cfg)


def _gpt_family(name: str, kind: str, cfg: dict) -> ModelSpec:
    h = _get(cfg, "hidden_size", "n_embd", "n_embed")
    layers = _get(cfg, "num_hidden_layers", "n_layer")
    heads = _get(cfg, "num_attention_heads", "n_head")
    vocab = cfg["vocab_size"]
    inter = _get(cfg, "intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", default=4 * h)
    hd = h // heads
    kv, positions, qkv_bias, mlp_bias = heads, 0, True, True
    norms, tied, final_norm = 2, True, True
    if kind == "gpt2":
        positions = cfg.get("n_positions", 1024)
    elif kind == "opt":
        positions = cfg.get("max_position_embeddings", 2048) + 2  # OPT's learned positions are offset by 2
        final_norm = cfg.get("do_layer_norm_before", True)
        if cfg.get("word_embed_proj_dim", h) != h:
            raise ConfigError("OPT with word_embed_proj_dim != hidden_size (opt-350m) is not modelled")
    elif kind == "gpt_neox":
        tied = bool(cfg.get("tie_word_embeddings", False))
    elif kind == "falcon":
        new = cfg.get("new_decoder_architecture", False)
        kv = cfg.get("num_kv_heads") or heads if new else (1 if cfg.get("multi_query", True) else heads)
        qkv_bias = mlp_bias = bool(cfg.get("bias", False))
        norms = 2 if new or not cfg.get("parallel_attn", True) else 1
    q = Linear("qkv", h, (heads + 2 * kv) * hd, layers, qkv_bias)
    linears = (q, Linear("proj", heads * hd, h, layers, qkv_bias), Linear("fc1", h, inter, layers, mlp_bias),
               Linear("fc2", inter, h, layers, mlp_bias))
    block = sum((lin.fan_in + lin.bias) * lin.fan_out for lin in linears) + norms * 2 * h
    embed = (vocab + positions) * h + (2 * h if kind == "bloom" else 0)  # BLOOM normalises its embeddings
    head = (2 * h if final_norm else 0) + (0 if tied else vocab * h)
    arch = dict(hidden=h, intermediate=inter, layers=layers, heads=heads, kv_heads=kv, head_dim=hd, vocab=vocab,
                max_seq=positions or cfg.get("max_position_embeddings", cfg.get("seq_length", 2048)), tied=tied,
                family=kind)
    return ModelSpec(name, "gpt", embed + layers * block + head, embed=embed, block=block, num_blocks=layers,
                     head=head, linears=linears, arch=arch)


def config_spec(path: str | Path) -> ModelSpec:
    """Spec of an HF config.json: the families above (llama, mistral, qwen2, mixtral,
    gpt2, gpt_neox, bloom, opt, falcon) by formula with their block layout; any other architecture is
    counted exactly on the meta device (Llama-shaped ones keep their layout, the rest are counts only)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {file} as a Hugging Face config.json ({exc}); "
                          "give a preset name or the path of a config.json") from exc
    if cfg.get("model_type") in FAMILIES:  # pure Python: the planner and estimator never import torch for these
        return family_spec(str(path), cfg)
    total = meta_param_count(file)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    if all(k in cfg for k in keys):
        spec = llama_spec(str(path), cfg)
        if spec.params == total:
            return spec
        # Not Llama-shaped (biases, different MLP): keep the exact count, drop the block layout.
        return ModelSpec(str(path), "params", total, arch={})
    return ModelSpec(str(path), "params", total)


def meta_param_count(config_file: Path) -> int:
    """Parameters of the model a config.json describes, built on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_file))
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as exc:  # not a causal LM transformers can build (T5, BERT, ...)
        raise ConfigError(f"{config_file}: model_type {config.model_type!r} is not a causal language model "
                          f"transformers can build ({str(exc).splitlines()[0][:120]}); give a decoder-only "
                          "model's config.json") from None
    return sum(p.numel() for p in model.parameters())  # parameters() yields each shared tensor once


def published_configs() -> dict:
    """Name -> HF config dict of the published models in labkit/data/model_configs.json (Llama 3 405B, BLOOM...)."""
    from importlib import resources

    data = json.loads(resources.files("labkit.data").joinpath("model_configs.json").read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def model_spec(model: str) -> ModelSpec:
    """The spec of a preset name or of a path to an HF config.json / checkpoint folder."""
    if model in presets.LLM_PRESETS:
        return llama_spec(model, dict(presets.LLM_PRESETS[model]))
    if model in presets.GPT_PRESETS:
        return gpt_spec(model, dict(presets.GPT_PRESETS[model]))
    if model in presets.VISION_PRESETS:
        return resnet_spec(model, dict(presets.VISION_PRESETS[model]))
    if model in published_configs():
        return family_spec(model, published_configs()[model])
    path = Path(model)
    from labkit.zoo import hub
    if hub.is_hub_id(model):  # config.json only, from the HF cache (labkit.zoo.hub): no weights are read
        return config_spec(hub.resolve(model, weights=False))
    if path.suffix == ".json" or (path / "config.json").is_file():
        if not (path.is_file() or (path / "config.json").is_file()):
            raise ConfigError(f"config file {model!r} does not exist; give a preset or an existing config.json")
        return config_spec(path)
    raise ConfigError(f"unknown model {model!r}; valid models are: {', '.join(presets.ALL_MODELS)}, "
                      f"the published models {', '.join(published_configs())}, "
                      "the path of a Hugging Face config.json, or a Hugging Face id ORG/NAME")
