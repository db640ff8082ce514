"""Model presets: published architecture shapes with random initialisation, no weights needed."""

from __future__ import annotations

from typing import Any

from common.json_types import JsonDict


def decoder(model_type: str, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, positions: int, **extra: Any) -> JsonDict:
    """A decoder's config.json values, in the order transformers' Llama-style configs name them."""
    shape = {"model_type": model_type, "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers}
    return {**shape, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": positions, **extra}


LLAMA_3_1_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# decoder(model type, vocabulary, hidden, intermediate, layers, attention heads, key/value heads, positions, other keys)
PRESETS: dict[str, JsonDict] = {
    # ~0.9M parameters: fast on a laptop CPU, the default everywhere.
    "tiny": decoder("llama", 320, 128, 344, 4, 4, 4, 4096, tie_word_embeddings=False),
    "gpt2": {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024},
    "llama-3.2-1b": decoder("llama", 128256, 2048, 8192, 16, 32, 8, 131072, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-3.1-8b": decoder("llama", 128256, 4096, 14336, 32, 32, 8, 131072, rope_theta=500000.0, rope_scaling=LLAMA_3_1_ROPE, tie_word_embeddings=False),
    # Llama-3.1-70B's published config: 80 layers of the 8B's design, 8192 wide; 141 GB of bf16.
    "llama-3.1-70b": decoder("llama", 128256, 8192, 28672, 80, 64, 8, 131072, rope_theta=500000.0, rope_scaling=LLAMA_3_1_ROPE, tie_word_embeddings=False),
    "qwen2.5-7b": decoder("qwen2", 152064, 3584, 18944, 28, 28, 4, 32768, rope_theta=1000000.0, tie_word_embeddings=False),
    "mistral-7b": decoder("mistral", 32768, 4096, 14336, 32, 32, 8, 32768, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False),
    # Mistral-Nemo-12B: head_dim 128 is not hidden / heads (160), so it is given explicitly.
    "mistral-nemo-12b": decoder(
        "mistral", 131072, 5120, 14336, 40, 32, 8, 128000, head_dim=128, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False
    ),
}

ALIASES = {
    "gpt2-124m": "gpt2",
    "llama3.2-1b": "llama-3.2-1b",
    "llama-1b": "llama-3.2-1b",
    "llama3-8b": "llama-3.1-8b",
    "llama-3-8b": "llama-3.1-8b",
    "llama3.1-8b": "llama-3.1-8b",
    "llama-3.1-8b-instruct": "llama-3.1-8b",
    "llama3.1-70b": "llama-3.1-70b",
    "llama-3.1-70b-instruct": "llama-3.1-70b",
    "mistral-nemo": "mistral-nemo-12b",
    "mistral-nemo-12b-instruct": "mistral-nemo-12b",
    "qwen2.5-7b-instruct": "qwen2.5-7b",
    "mistral": "mistral-7b",
}


def canonical_preset(name: str) -> str | None:
    key = name.lower()
    key = ALIASES.get(key, key)
    return key if key in PRESETS else None
