"""The Llama's shape and hyperparameters: what every loader reads from a checkpoint and every part of the
model (attention, KV cache, kernels) sizes itself from. A leaf module, so that those parts can share it
without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF's dict ("llama3", "linear"), or {"rope_type": "freq_factors", "factors": [...]} from a GGUF
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
