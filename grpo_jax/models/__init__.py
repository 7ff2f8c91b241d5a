"""Decoder models (Llama / Qwen2 / Qwen3), checkpoint loading and tokenizers.

Submodules: config (ModelConfig, PRESETS, get_preset), transformer (Transformer, CriticModel,
KVCache, init_cache), loading (load_hf_checkpoint, load_gguf, save_hf_checkpoint, gguf_to_hf),
tokenizer (Tokenizer, CharTokenizer).
"""

from grpo_jax.models.config import PRESETS, ModelConfig, get_preset
from grpo_jax.models.transformer import (
    CriticModel,
    KVCache,
    Transformer,
    init_cache,
    positions_from_mask,
)

__all__ = [
    "PRESETS",
    "ModelConfig",
    "get_preset",
    "CriticModel",
    "KVCache",
    "Transformer",
    "init_cache",
    "positions_from_mask",
]
