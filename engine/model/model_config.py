"""The model's shape and hyperparameters: what every loader reads from a checkpoint and every part of the
model (attention, KV cache, kernels) sizes itself from. A leaf module, so that those parts can share it
without importing each other.

The families Headroom serves (engine/model/families.py) are all one decoder written once (engine/model/llama.py):
what sets them apart is data here, each field defaulting to what Llama does."""

from __future__ import annotations

from dataclasses import dataclass, field
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
    # HF's dict ("llama3", "linear", "longrope"), or {"rope_type": "freq_factors", "factors": [...]} from a GGUF
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"  # HF's name for the family (engine/model/families.py)
    attention_bias: bool = False  # Qwen2: q, k and v have biases
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head of q and of k, before RoPE
    sandwich_norms: bool = False  # Gemma 2/3: a norm on the attention's and the MLP's output, before each add
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    embed_scale: float = 1.0  # Gemma: the embeddings times sqrt(hidden_size), in the model dtype
    attn_scale: float | None = None  # the scores' scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_softcap: float | None = None  # Gemma 2: scores become cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the logits, the same way
    sliding_window: int | None = None  # keys a sliding layer's token sees, itself included
    sliding_layers: list[int] = field(default_factory=list)  # the layers that use `sliding_window`
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own RoPE base (and no scaling)
    # mixture of experts (Qwen3-MoE): the MLP of each layer in `moe_layers` is `num_experts` experts of
    # `moe_intermediate_size` features, `experts_per_token` of them for each token
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the chosen experts' weights renormalized to sum to one
    moe_layers: list[int] = field(default_factory=list)

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale

    def window(self, layer: int) -> int | None:
        """The keys layer `layer`'s tokens see (None: every earlier one)."""
        return self.sliding_window if layer in self.sliding_layers else None
