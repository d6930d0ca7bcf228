"""The model families Headroom serves, and how an HF config.json says which one a checkpoint is and how it
differs from Llama. Every family runs on the one decoder in engine/model/llama.py: what is particular to
each is read here into engine/model/model_config.py's fields, so adding a family is a few lines of data.

Both config.json layouts are read: transformers 5's `rope_parameters` and `layer_types`, and the older
`rope_theta` / `rope_scaling` / per-family rules for which layers slide, as most published checkpoints have."""

from __future__ import annotations

from typing import Any

from engine.model.model_config import ModelConfig

# HF architecture -> what sets the family apart from Llama (the refusal message lists them)
FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "Llama 2/3, SmolLM",
    "MistralForCausalLM": "Mistral: sliding-window attention",
    "Qwen2ForCausalLM": "Qwen2, Qwen2.5: q/k/v biases",
    "Qwen3ForCausalLM": "Qwen3: q/k norms",
    "Qwen3MoeForCausalLM": "Qwen3-MoE: q/k norms, a mixture of experts",
    "Gemma2ForCausalLM": "Gemma 2: GeGLU, sandwich norms, soft-capping, alternating sliding layers",
    "Gemma3ForCausalLM": "Gemma 3 (text): GeGLU, sandwich norms, q/k norms, local layers with their own RoPE base",
    "Phi3ForCausalLM": "Phi-3: fused q/k/v and gate/up, longrope",
}
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
ROPE_KINDS = {"linear", "llama3", "longrope"}


class UnsupportedModelError(ValueError):
    """A checkpoint Headroom cannot serve: a start-up error whose message says what it can serve instead."""


def unsupported(architectures: list[str]) -> str:
    listed = ", ".join(FAMILIES)
    return f"architecture {architectures} is not supported; Headroom serves {listed}"


def architecture_of(c: dict[str, Any]) -> str:
    """The checkpoint's family: its first architecture Headroom serves; else UnsupportedModelError."""
    names = c.get("architectures") or ["LlamaForCausalLM"]
    for name in names:
        if name in FAMILIES:
            return name
    raise UnsupportedModelError(unsupported(names))


def family_traits(arch: str, hidden_size: int) -> dict[str, Any]:
    """The ModelConfig fields a family fixes, whichever format its checkpoint comes in: `config_from_hf` and the
    GGUF loader (engine/model/loaders/gguf.py) both take them from here."""
    gemma = arch in GEMMA
    return {
        "architecture": arch,
        "attention_bias": arch == "Qwen2ForCausalLM",
        "qk_norm": arch in QK_NORM,
        "sandwich_norms": gemma,
        "embed_scale": hidden_size**0.5 if gemma else 1.0,
    }


def config_from_hf(c: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of an HF config.json's contents."""
    arch = architecture_of(c)
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    theta, scaling = _rope(c, "full_attention")
    gemma = arch in GEMMA
    if c.get("mlp_bias") or (arch != "Qwen2ForCausalLM" and c.get("attention_bias")):
        raise UnsupportedModelError(f"{arch} with biases on the output or MLP projections is not supported")
    activation = c.get("hidden_activation") or c.get("hidden_act") or "silu"
    if activation not in ACTIVATIONS:
        raise UnsupportedModelError(f"activation {activation!r} is not supported: {', '.join(ACTIVATIONS)}")
    sliding = _sliding_layers(arch, c)
    local_theta = _rope(c, "sliding_attention")[0] if arch == "Gemma3ForCausalLM" else None
    experts = (c.get("num_experts") or c.get("num_local_experts") or 0) if arch == "Qwen3MoeForCausalLM" else 0
    step, dense_only = c.get("decoder_sparse_step") or 1, set(c.get("mlp_only_layers") or [])
    layers = c["num_hidden_layers"]
    return ModelConfig(
        vocab_size=c["vocab_size"],
        hidden_size=hidden,
        intermediate_size=c["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or hidden // heads,
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=c.get("max_position_embeddings", 2048),
        tie_word_embeddings=c.get("tie_word_embeddings", gemma),
        **family_traits(arch, hidden),
        activation=ACTIVATIONS[activation],
        attn_scale=c["query_pre_attn_scalar"] ** -0.5 if gemma else None,
        attn_softcap=c.get("attn_logit_softcapping") if gemma else None,
        final_softcap=c.get("final_logit_softcapping") if gemma else None,
        sliding_window=c.get("sliding_window") if sliding else None,
        sliding_layers=sliding,
        local_rope_theta=local_theta,
        num_experts=experts,
        experts_per_token=c.get("num_experts_per_tok", 0) if experts else 0,
        moe_intermediate_size=c.get("moe_intermediate_size", 0) if experts else 0,
        norm_topk_prob=bool(c.get("norm_topk_prob")) if experts else False,
        moe_layers=[i for i in range(layers) if experts and i not in dense_only and (i + 1) % step == 0],
    )


def _rope(c: dict[str, Any], layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling) of a layer type's RoPE. UnsupportedModelError for a scaling not implemented
    (engine/model/llama.py `rope_tables`) and for partial rotary embeddings."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:  # transformers 5, a table per layer type (Gemma 3)
        params = params[layer_type]
    if params is None:  # the older layout
        local = layer_type == "sliding_attention" and "rope_local_base_freq" in c
        theta = c["rope_local_base_freq"] if local else c.get("rope_theta", 10000.0)
        params = {} if local else dict(c.get("rope_scaling") or {})
    else:
        theta, params = params.get("rope_theta", c.get("rope_theta", 10000.0)), dict(params)
        params.pop("rope_theta", None)
    if params.pop("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    kind = params.pop("type", None) or params.get("rope_type") or "default"
    kind = "longrope" if kind == "su" else kind  # Phi-3's first name for it
    if kind == "default":
        return float(theta), None
    if kind not in ROPE_KINDS:
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported: {', '.join(sorted(ROPE_KINDS))}")
    params["rope_type"] = kind
    if kind == "longrope":
        params.setdefault("original_max_position_embeddings", c.get("original_max_position_embeddings"))
    return float(theta), params


def _sliding_layers(arch: str, c: dict[str, Any]) -> list[int]:
    """The layers that attend within `sliding_window`: config.json's `layer_types` where it has them, else
    each family's rule (Mistral and Phi-3: every layer; Gemma 2: every other one from the first; Gemma 3:
    all but each `sliding_window_pattern`-th; Qwen: those from `max_window_layers` on, if it slides at all)."""
    layers = c["num_hidden_layers"]
    if not c.get("sliding_window"):
        return []
    if types := c.get("layer_types"):
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return list(range(layers))
    if arch == "Gemma2ForCausalLM":
        return [i for i in range(layers) if i % 2 == 0]
    if arch == "Gemma3ForCausalLM":
        pattern = c.get("sliding_window_pattern", 6)
        return [i for i in range(layers) if (i + 1) % pattern]
    if c.get("use_sliding_window"):
        return list(range(c.get("max_window_layers", 0), layers))
    return []


def hf_weights_as_llama(cfg: ModelConfig, weights: dict[str, Any]) -> None:
    """Make an HF checkpoint's weights mean what engine/model/llama.py reads, in place: Gemma's RMSNorms scale
    by (1 + weight), so one is added to each of its norms' weights (llama.cpp's converter does the same, so a
    GGUF needs nothing)."""
    if cfg.architecture in GEMMA:
        for name in [n for n in weights if n.endswith("norm.weight")]:
            weights[name] = weights[name].float() + 1
