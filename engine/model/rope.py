"""RoPE's rotation tables, with the scalings the families use (HF's llama3 and linear, llama.cpp's frequency
factors, Phi-3's longrope), in float32 for the model to cast once."""

from __future__ import annotations

import math

import torch

from engine.model.model_config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with HF's rope scaling applied (`theta`, `scaling`: a layer's own
    base and scaling, default the model's)."""
    theta = cfg.rope_theta if theta is None else theta
    inv_freq = 1.0 / theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    scaling = cfg.rope_scaling if scaling is None else scaling
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "freq_factors":
        return (inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)).float()
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}: llama3, linear and (Phi-3) longrope are implemented")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled).float()


def rope_tables(cfg: ModelConfig, theta: float | None = None, scaling: dict | None = None) -> torch.Tensor:
    """The rotation angles' (cos, sin) tables as one float32 [2, max_position_embeddings, head_dim].

    Phi-3's longrope divides the frequencies by its short factors up to the original context and by its long
    ones past it, per position as vLLM does (HF switches the whole sequence once it grows past the original
    context: the two agree on every position below it), and scales both by its attention factor."""
    positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
    scaling = cfg.rope_scaling if scaling is None else scaling
    if (scaling or {}).get("rope_type") == "longrope":
        original = scaling["original_max_position_embeddings"]
        base = rope_inv_freq(cfg, theta, {}).double()
        short = torch.outer(positions, (base / torch.tensor(scaling["short_factor"], dtype=torch.float64)).float())
        long = torch.outer(positions, (base / torch.tensor(scaling["long_factor"], dtype=torch.float64)).float())
        freqs = torch.where(positions[:, None] < original, short, long)
        factor = cfg.max_position_embeddings / original
        default = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        magnitude = scaling.get("attention_factor") or default
    else:
        freqs, magnitude = torch.outer(positions, rope_inv_freq(cfg, theta, scaling)), 1.0
    angles = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((angles.cos() * magnitude, angles.sin() * magnitude))
