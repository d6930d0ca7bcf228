"""A tiny random model of each family Headroom serves, made with transformers' own classes (float32) and saved
as transformers saves it, with the small BPE tokenizer of tests/fixtures_llama.py: the reference every family
is checked against (tests/test_model_families.py), with no download.

The weights are drawn wider than transformers' initializer (std 0.02) so that greedy choices have clear margins:
two correct float32 implementations then pick the same token, where near-uniform logits would leave the
choice to rounding. The shapes make every family's particulars matter: a sliding window shorter than the
text, several layers of each kind, experts most tokens skip."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.fixtures_llama import SMOL_STYLE, train_tokenizer

INIT_STD = 0.15
WINDOW = 12  # keys a sliding layer's token sees: the tests' texts run past it
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
# family -> (transformers' config and model class names, what it sets beyond SHAPE)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 500000.0}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
            "tie_word_embeddings": True,
        },
    ),  # fmt: skip
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 16,
            "tie_word_embeddings": True,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        },
    ),  # fmt: skip
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "max_position_embeddings": 512,
            "original_max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.05 * i for i in range(8)],
                "long_factor": [1.5 + 0.25 * i for i in range(8)],
            },
        },
    ),  # fmt: skip
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True},
    ),
}


@dataclass
class TinyFamily:
    name: str
    hf_dir: Path
    model: torch.nn.Module  # transformers' model, float32, eval


def build(name: str, path: Path, seed: int = 0) -> TinyFamily:
    """The family's tiny model saved to `path` (safetensors, config.json, tokenizer)."""
    import transformers

    config_class, model_class, extra = FAMILIES[name]
    tok = train_tokenizer()
    special = {t: tok.token_to_id(t) for t in SMOL_STYLE.special_tokens}
    bos, eos = special[SMOL_STYLE.bos], special[SMOL_STYLE.eos]
    config = getattr(transformers, config_class)(
        vocab_size=tok.get_vocab_size(), bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, **{**SHAPE, **extra}
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:  # Gemma's scale by (1 + w): both kinds stay near one
                p.normal_(0.0 if name.startswith("gemma") else 1.0, 0.1)
            else:
                p.normal_(0.0, INIT_STD)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": SMOL_STYLE.chat_template, "bos_token": SMOL_STYLE.bos, "eos_token": SMOL_STYLE.eos}
        )
    )
    return TinyFamily(name, path, model)


def greedy(family: TinyFamily, prompt: list[int], tokens: int) -> list[int]:
    """transformers' model's own greedy continuation of `prompt`, every token its forward's argmax (EOS
    included, as the server's `ignore_eos` lets it be chosen; `generate` would stop there or mask it)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(tokens):
            ids.append(int(family.model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
