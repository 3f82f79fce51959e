"""Hugging Face config.json -> `ModelSpec`, by architecture family, in pure Python (no torch).

`labkit memory estimate --model` and `labkit plan --model` read a preset, an HF id in the local cache, a
folder or a config.json; this module turns the config of a known family into the exact parameter layout
(embedding / one block / head), the linears and the architecture numbers the activation and time models
use. Counts are exact: tests/test_planner_models.py builds each family on torch's meta device and compares.

  llama, mistral, qwen2, mixtral   gated SwiGLU MLP, RMSNorm, rotary; qwen2 adds q/k/v biases; mixtral's
                                   MLP is E experts + a router (`labkit.memory.params.llama_spec`)
  gpt2, gpt_neox, bloom, opt,      GPT-style blocks: one attention (fused or separate q/k/v), a 4h (or
  falcon                           ffn_dim) GeLU/ReLU MLP, LayerNorms with biases (Korthikanti et al.'s
                                   activation formula applies)
Introduced in notebook 07_model_parallel.
"""
from __future__ import annotations

from labkit.errors import ConfigError
from labkit.memory.params import Linear, ModelSpec, llama_spec

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
