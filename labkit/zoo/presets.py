"""Model architecture presets as plain numbers (no torch import).

The memory estimator (`labkit.memory`) and the model builders (`labkit.zoo.models`) share these, so the
name a student types (`--model llama2-7b`) means the same architecture everywhere. Transformer
presets use Hugging Face `LlamaConfig` field names so `labkit.zoo.models` can build them directly.
Introduced in notebook 01_memory.
"""
from __future__ import annotations

from types import MappingProxyType

from labkit.errors import choices_error

#: Llama-family architectures (HF LlamaConfig keys). Sources: the models' published config.json.
LLM_PRESETS = MappingProxyType({
    # Tiny smoke model: a real LlamaForCausalLM, seconds per CPU step, 2 layers so it can be
    # pipelined over 2 ranks and its 4 heads / 2 kv-heads split over tensor-parallel 2.
    "tiny-llama": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=False),
    # Tiny mixture of experts (HF Mixtral layout, Jiang et al. 2024): tiny-llama's attention, and in
    # place of its MLP 4 SwiGLU experts of width 64 with a top-2 router, so expert parallelism splits
    # them 2 + 2 over 2 ranks. `num_local_experts` marks an MoE preset (labkit.zoo.models builds Mixtral).
    "tiny-moe": dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                     router_aux_loss_coef=0.01, output_router_logits=True),
    # A 160M Llama (JackFram/llama-160m's config.json): the LLM of the free T4 profiles, where
    # TinyLlama's fp32 AdamW states alone (~17.6 GB) exceed a 16 GB T4. 12 heads / 12 layers split over 2.
    "llama-160m": dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                       tie_word_embeddings=False),
    "tinyllama-1.1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                           num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                           max_position_embeddings=2048, tie_word_embeddings=False),
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        max_position_embeddings=131072, tie_word_embeddings=True),
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      max_position_embeddings=4096, tie_word_embeddings=False),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, tie_word_embeddings=False),
})

#: GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, d_model 12288, 96 heads, context 2048.
#: A GPT-style block (4d MLP, learned positions), not Llama: the estimator counts it by formula.
GPT_PRESETS = MappingProxyType({
    "gpt3-175b": dict(vocab_size=50257, hidden_size=12288, intermediate_size=4 * 12288,
                      num_hidden_layers=96, num_attention_heads=96, max_position_embeddings=2048),
})

#: Vision models (torchvision). `tiny-resnet` is a ResNet with Bottleneck blocks [1,1,1,1] at
#: 32x32 for smoke runs; `resnet50` is torchvision's (25,557,032 parameters).
VISION_PRESETS = MappingProxyType({
    "tiny-resnet": dict(block="bottleneck", layers=(1, 1, 1, 1), num_classes=10, image_size=32),
    "resnet50": dict(block="bottleneck", layers=(3, 4, 6, 3), num_classes=1000, image_size=224),
})

ALL_MODELS = tuple(LLM_PRESETS) + tuple(GPT_PRESETS) + tuple(VISION_PRESETS)


def model_kind(name: str) -> str:
    """'llm', 'gpt' or 'vision' for a preset name; ConfigError listing the valid names otherwise."""
    if name in LLM_PRESETS:
        return "llm"
    if name in GPT_PRESETS:
        return "gpt"
    if name in VISION_PRESETS:
        return "vision"
    raise choices_error("model", name, ALL_MODELS)
