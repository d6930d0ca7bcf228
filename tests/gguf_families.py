"""A tiny model of each family (tests/tiny_families.py) written as a GGUF the way llama.cpp's converter
(convert_hf_to_gguf.py) writes that family: its architecture's metadata keys, tensor names from gguf's own tables
(gguf.get_tensor_name_map), q/k rows permuted for Llama and Mistral, Gemma's norms stored as 1 + w, each MoE
layer's experts stacked into 3-D tensors, Phi-3's longrope factors as tensors, the tokenizer and chat template.
A reference for engine/model/loaders/gguf.py that shares nothing with it.

A GGUF does not say all that config.json says: `build_as_gguf` makes each family with what its GGUF can say."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any
from unittest.mock import patch

import gguf
import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from tests.fixtures_llama import SMOL_STYLE, add_tokenizer, add_weight, llama_cpp_permute, write
from tests.tiny_families import FAMILIES, SHAPE, TinyFamily, build

ARCHITECTURES = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "mistral": gguf.MODEL_ARCH.LLAMA,  # the converter's LlamaModel takes MistralForCausalLM too
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
}
# What a family's GGUF cannot carry, so what it is built with here for its GGUF to describe it exactly: Mistral's
# window (the converter writes Mistral as llama, with none), Gemma 2's query_pre_attn_scalar (llama.cpp scales by
# head_dim), Gemma 3's layer types (llama.cpp slides all but every sixth layer: with six, one is global).
AS_GGUF: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": None},
    "gemma2": {"query_pre_attn_scalar": SHAPE["head_dim"]},
    "gemma3": {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
}
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+\.weight)")


def build_as_gguf(name: str, path: Path) -> TinyFamily:
    """tests/tiny_families.py `build`, with the family's AS_GGUF settings."""
    config_class, model_class, extra = FAMILIES[name]
    with patch.dict(FAMILIES, {name: (config_class, model_class, extra | AS_GGUF.get(name, {}))}):
        return build(name, path)


def save_family_gguf(
    family: TinyFamily, path: Path, qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F16
) -> None:
    """The family's checkpoint (family.hf_dir) as llama.cpp's converter writes it, matrices in `qtype`."""
    c = json.loads((family.hf_dir / "config.json").read_text())
    arch = ARCHITECTURES[family.name]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    add_metadata(w, family.name, c)
    add_tokenizer(w, Tokenizer.from_file(str(family.hf_dir / "tokenizer.json")), SMOL_STYLE)
    names = gguf.get_tensor_name_map(arch, c["num_hidden_layers"])
    for name, a in converted(family.name, c, read_weights(family.hf_dir)).items():
        add_weight(w, names.get_name(name, try_suffixes=(".weight", ".bias")), a, qtype)
    if family.name == "phi3":  # Phi3MiniModel's longrope factors
        long, short = gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT
        for tensor, factors in [(long, "long_factor"), (short, "short_factor")]:
            a = np.array(c["rope_parameters"][factors], np.float32)
            add_weight(w, gguf.TENSOR_NAMES[tensor] + ".weight", a, qtype)
    write(w)


def read_weights(hf_dir: Path) -> dict[str, np.ndarray]:
    return {name: a for f in sorted(hf_dir.glob("*.safetensors")) for name, a in load_file(f).items()}


def converted(family: str, c: dict[str, Any], weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The HF weights as the converter changes them before naming them: Llama's q/k rows permuted (LlamaModel
    `permute`), one added to Gemma's norms, each MoE layer's experts stacked per projection (Qwen2MoeModel)."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, list[tuple[int, np.ndarray]]] = defaultdict(list)
    for name, a in weights.items():
        if family in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            a = llama_cpp_permute(a, c["num_attention_heads" if "q_proj" in name else "num_key_value_heads"])
        if family.startswith("gemma") and name.endswith("norm.weight"):
            a = a + 1
        if m := _EXPERT.fullmatch(name):
            experts[f"{m[1]}.{m[3]}"].append((int(m[2]), a))
        else:
            out[name] = a
    for name, parts in experts.items():
        out[name] = np.stack([a for _, a in sorted(parts, key=lambda p: p[0])])
    return out


def add_metadata(w: gguf.GGUFWriter, family: str, c: dict[str, Any]) -> None:
    """The `<arch>.*` keys the converter writes: Gemma2Model and Phi3MiniModel write their own sets, the other
    families TextModel's with their classes' additions."""
    for add, key in [
        (w.add_block_count, "num_hidden_layers"),
        (w.add_context_length, "max_position_embeddings"),
        (w.add_embedding_length, "hidden_size"),
        (w.add_feed_forward_length, "intermediate_size"),
        (w.add_head_count, "num_attention_heads"),
        (w.add_head_count_kv, "num_key_value_heads"),
        (w.add_layer_norm_rms_eps, "rms_norm_eps"),
    ]:
        add(c[key])
    if family == "gemma2":  # no RoPE keys: llama.cpp's default base, 10000, is Gemma 2's
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(c["sliding_window"])
    elif family == "phi3":
        add_phi3_rope(w, c)
        w.add_sliding_window(c.get("sliding_window") or 0)  # zero: none
    else:
        add_text_model_keys(w, family, c)


def add_text_model_keys(w: gguf.GGUFWriter, family: str, c: dict[str, Any]) -> None:
    """TextModel.set_gguf_parameters' RoPE, expert and head-size keys, and LlamaModel's, Qwen2MoeModel's and
    Gemma3Model's own."""
    rope = c["rope_parameters"]
    full = rope.get("full_attention", rope)  # Gemma 3 has a table per layer type
    if full["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_rope_freq_base(full["rope_theta"])
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if experts := c.get("num_local_experts") or c.get("num_experts"):  # transformers 5 writes the first
        w.add_expert_count(experts)
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    if family in ("llama", "mistral"):
        w.add_vocab_size(c["vocab_size"])
        w.add_rope_dimension_count(c["head_dim"])
    if family == "gemma3":
        w.add_sliding_window(c["sliding_window"])


def add_phi3_rope(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    """Phi3MiniModel's RoPE keys (its factors are tensors: save_family_gguf), with the longrope attention factor
    the converter computes from the context lengths."""
    rope, heads = c["rope_parameters"], c["num_attention_heads"]
    original = rope["original_max_position_embeddings"]
    scale = c["max_position_embeddings"] / original
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_dimension_count(c["hidden_size"] // heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
