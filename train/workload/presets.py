"""Model presets: architecture shapes with random initialisation, no weights needed.

Throughput and memory depend on shapes, not weight values, so a preset measures exactly what
the real model costs. Numbers are the published configs of each architecture.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # ~0.9M parameters: fast on a laptop CPU, the default everywhere.
    "tiny": {
        "model_type": "llama",
        "vocab_size": 320,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "gpt2": {
        "model_type": "gpt2",
        "vocab_size": 50257,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_positions": 1024,
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False,
    },
    # Llama-3.1-70B's published config: 80 layers of the 8B's design, 8192 wide; 141 GB of bf16.
    "llama-3.1-70b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "mistral-7b": {
        "model_type": "mistral",
        "vocab_size": 32768,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # Mistral-Nemo-12B: head_dim 128 is not hidden / heads (160), so it is given explicitly.
    "mistral-nemo-12b": {
        "model_type": "mistral",
        "vocab_size": 131072,
        "hidden_size": 5120,
        "intermediate_size": 14336,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 128000,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
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


def preset_names() -> list[str]:
    return list(PRESETS)


def canonical_preset(name: str) -> str | None:
    key = name.lower()
    key = ALIASES.get(key, key)
    return key if key in PRESETS else None
