"""An HF-named checkpoint's weights (from safetensors or a GGUF) into the model's fused layout: q/k/v and gate/up
concatenated (or taken as shipped fused, as Phi-3 ships them), an MoE layer's experts stacked, and where asked
the matrices kept in their quantized blocks (engine/model/quant.py)."""

from __future__ import annotations

import torch
from torch import nn

from engine.model import quant
from engine.model.quant import RawQuant, is_packed


def load_hf_weights(model: nn.Module, weights: dict[str, torch.Tensor | RawQuant], quantization: str | None) -> None:
    """Copy HF-named weights (`model.layers.0.self_attn.q_proj.weight`, ...) into the fused layout of `model`
    (an engine/model/llama.py LlamaModel, which calls this: typed by its base class, so neither module imports
    the other). The dict is consumed, so each source tensor can be freed once copied. `quantization`
    (engine/model/quant.py): None, float weights; AS_SHIPPED, the linears and embedding that ship quantized stay
    so; a type, every linear and the embedding in it. A quantized weight replaces its float parameter with its
    packed bytes."""

    def take(*names: str, keep_float: bool = False) -> torch.Tensor:
        try:
            return fused_weight([weights.pop(n) for n in names], None if keep_float else quantization)
        except KeyError as e:
            raise KeyError(f"checkpoint is missing {e.args[0]}") from None

    with torch.no_grad():
        assign(model, "embed", take("model.embed_tokens.weight"))
        assign(model, "norm", take("model.norm.weight"))
        if not model.cfg.tie_word_embeddings:
            assign(model, "lm_head", take("lm_head.weight"))
        weights.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
        for i, layer in enumerate(model.layers):
            n = f"model.layers.{i}."
            attn, mlp = n + "self_attn.", n + "mlp."
            assign(layer, "attn_norm", take(n + "input_layernorm.weight"))
            if layer.post_attn_norm is not None:  # Gemma's names: the norm after attention, then the MLP's
                assign(layer, "post_attn_norm", take(n + "post_attention_layernorm.weight"))
                assign(layer, "mlp_norm", take(n + "pre_feedforward_layernorm.weight"))
                assign(layer, "post_mlp_norm", take(n + "post_feedforward_layernorm.weight"))
            else:
                assign(layer, "mlp_norm", take(n + "post_attention_layernorm.weight"))
            fused_qkv = attn + "qkv_proj.weight"  # Phi-3 ships q/k/v (and gate/up) fused, as they run here
            qkv = [fused_qkv] if fused_qkv in weights else [f"{attn}{x}_proj.weight" for x in "qkv"]
            assign(layer, "wqkv", take(*qkv))
            if layer.qkv_bias is not None:
                assign(layer, "qkv_bias", take(*(f"{attn}{x}_proj.bias" for x in "qkv")))
            if layer.q_norm is not None:
                assign(layer, "q_norm", take(attn + "q_norm.weight"))
                assign(layer, "k_norm", take(attn + "k_norm.weight"))
            assign(layer, "wo", take(attn + "o_proj.weight"))
            if layer.moe:
                assign(layer, "router", take(mlp + "gate.weight"))
                e = [f"{mlp}experts.{j}." for j in range(model.cfg.num_experts)]
                # the experts stay float: one packed matrix a weight (engine/model/quant.py) has no expert axis
                gate_up = [take(x + "gate_proj.weight", x + "up_proj.weight", keep_float=True) for x in e]
                assign(layer, "experts_gate_up", torch.stack(gate_up))
                down = [take(x + "down_proj.weight", keep_float=True) for x in e]
                assign(layer, "experts_down", torch.stack(down))
                continue
            fused_mlp = mlp + "gate_up_proj.weight"
            gate_up = [fused_mlp] if fused_mlp in weights else [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
            assign(layer, "w_gate_up", take(*gate_up))
            assign(layer, "w_down", take(mlp + "down_proj.weight"))
    if model.cfg.tie_word_embeddings:
        model.lm_head = model.embed
    unused = [n for n in weights if not n.endswith("rotary_emb.inv_freq")]
    if unused:
        raise ValueError(f"checkpoint has weights this {model.cfg.architecture} does not use: {unused[:5]}")


def fused_weight(parts: list[torch.Tensor | RawQuant], quantization: str | None) -> torch.Tensor:
    """One weight from its checkpoint parts (q/k/v, gate/up, or a single one): packed quantized bytes where
    `quantization` asks for them (engine/model/quant.py), else the floats, dequantized where they ship quantized.
    Parts that ship quantized in the asked type (or, AS_SHIPPED, in one type) are packed as they are. A matrix
    whose outputs are not whole blocks of 16, or whose inputs are not whole blocks of 32, stays float (a
    vocabulary of 32,001, say); so do the norms."""
    kinds = {p.kind if isinstance(p, RawQuant) else None for p in parts}
    (kind,) = kinds if len(kinds) == 1 else (None,)
    rows = sum(p.data.shape[0] if isinstance(p, RawQuant) else p.shape[0] for p in parts)
    if kind is not None and quantization in (quant.AS_SHIPPED, kind) and quant.packable(rows):
        return quant.pack(quant.concat(parts))  # type: ignore[arg-type]
    floats = torch.cat([torch.from_numpy(p.floats()) if isinstance(p, RawQuant) else p for p in parts])
    blocks = floats.dim() == 2 and quant.packable(rows) and floats.shape[1] % quant.QK == 0
    if quantization in quant.KINDS and blocks:
        return quant.pack(quant.quantize(floats.float().numpy(), quantization))  # type: ignore[arg-type]
    return floats


def assign(module: nn.Module, name: str, weight: torch.Tensor) -> None:
    """Copy a float weight into its parameter (cast to its dtype); a packed one replaces the parameter."""
    if is_packed(weight):
        setattr(module, name, nn.Parameter(weight, requires_grad=False))
    else:
        getattr(module, name).copy_(weight)
