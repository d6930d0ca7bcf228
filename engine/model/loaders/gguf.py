"""GGUF (llama.cpp) files: config from `llama.*` metadata, weights to HF names and layout (dequantized, or
their Q8_0/Q4_0/Q4_1 blocks kept as they ship: engine/model/quant.py), and the tokenizer rebuilt from
`tokenizer.ggml.*`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.model.model_config import ModelConfig
from engine.model.quant import KINDS, RawQuant
from engine.model.tokenizer import Tokenizer, special_tokens_processor

SUPPORTED_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class _Reader(GGUFReader):
    """GGUFReader slices its np.memmap once per metadata value, and memmap's Python-level
    __array_finalize__ makes that cost seconds for a large vocabulary. A plain ndarray view of the same
    mapping reads the same bytes without that per-slice cost."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = _Reader(self.path)
        arch = self.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"{self.path.name}: architecture {arch!r} is not supported, only llama")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def get_float(self, key: str, default: float) -> float:
        """Float metadata is float32: take the shortest decimal that round-trips (1e-05, not 9.99e-06),
        which is the value the converter was given."""
        value = self.get(key)
        return default if value is None else float(str(np.float32(value)))

    def config(self) -> ModelConfig:
        hidden = self.get("llama.embedding_length")
        heads = self.get("llama.attention.head_count")
        names = {t.name for t in self.reader.tensors}
        rope_scaling = None
        if self.get("llama.rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": "linear", "factor": self.get_float("llama.rope.scaling.factor", 1.0)}
        if "rope_freqs.weight" in names:  # llama 3.x: the converter stores llama3 scaling as divisors
            factors = next(t for t in self.reader.tensors if t.name == "rope_freqs.weight")
            rope_scaling = {"rope_type": "freq_factors", "factors": [float(x) for x in factors.data]}
        return ModelConfig(
            vocab_size=self.get("llama.vocab_size") or len(self.get("tokenizer.ggml.tokens")),
            hidden_size=hidden,
            intermediate_size=self.get("llama.feed_forward_length"),
            num_layers=self.get("llama.block_count"),
            num_heads=heads,
            num_kv_heads=self.get("llama.attention.head_count_kv", heads),
            head_dim=self.get("llama.attention.key_length", hidden // heads),
            rms_norm_eps=self.get_float("llama.attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=self.get_float("llama.rope.freq_base", 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=self.get("llama.context_length", 2048),
            tie_word_embeddings="output.weight" not in names,
        )

    def weights(self, cfg: ModelConfig, keep_quantized: bool = False) -> dict[str, torch.Tensor | RawQuant]:
        """HF-named float32 tensors; with `keep_quantized`, the Q8_0/Q4_0/Q4_1 matrices as RawQuant (their
        blocks, rows permuted as below, nothing dequantized). llama.cpp's converter permutes q/k rows so that
        each head's rotary pairs are adjacent (GPT-J style); `_unpermute` restores HF's rotate_half order."""
        out: dict[str, torch.Tensor | RawQuant] = {}
        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight":
                continue
            if t.tensor_type not in SUPPORTED_TYPES:
                raise ValueError(f"{self.path.name}: tensor {t.name} has unsupported type {t.tensor_type.name}")
            shape = [int(n) for n in reversed(t.shape)]
            kind = t.tensor_type.name.lower()
            if keep_quantized and kind in KINDS and len(shape) == 2:
                array = np.asarray(t.data).reshape(shape[0], -1)  # [rows, row bytes], still the mapped file
            else:  # F32 tensors come back as read-only views of the mapped file: copy those only
                array = np.require(dequantize(t.data, t.tensor_type), np.float32, ["C", "W"]).reshape(shape)
            name = _hf_name(t.name)
            if name.endswith("q_proj.weight"):
                array = _unpermute(array, cfg.num_heads)
            elif name.endswith("k_proj.weight"):
                array = _unpermute(array, cfg.num_kv_heads)
            out[name] = RawQuant(array, kind) if array.dtype == np.uint8 else torch.from_numpy(array)
        return out

    def tokenizer(self, name: str) -> Tokenizer:
        kind = self.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"{self.path.name}: tokenizer model {kind!r} is not supported, only byte-level BPE (gpt2)")
        tokens: list[str] = self.get("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in self.get("tokenizer.ggml.merges")]
        bpe = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
        bpe.pre_tokenizer = _pre_tokenizer(self.get("tokenizer.ggml.pre", "default"))
        bpe.decoder = decoders.ByteLevel()
        types = self.get("tokenizer.ggml.token_type") or []
        special = [tokens[i] for i, k in enumerate(types) if k in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
        bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        eos = self.get("tokenizer.ggml.eos_token_id")
        eot = self.get("tokenizer.ggml.eot_token_id")
        bos = self.get("tokenizer.ggml.bos_token_id")
        # what llama.cpp adds (its converters write these keys from the HF tokenizer's post-processor)
        bpe.post_processor = special_tokens_processor(
            bpe,
            bos if self.get("tokenizer.ggml.add_bos_token", False) else None,
            eos if self.get("tokenizer.ggml.add_eos_token", False) else None,
        )
        return Tokenizer(
            bpe,
            name=name,
            eos_token_ids={i for i in (eos, eot) if i is not None},
            bos_token_id=bos,
            chat_template=self.get("tokenizer.chat_template"),
        )


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    blk, layer, part, suffix = name.split(".")
    if blk != "blk" or part not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name}")
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert's `permute`: per head, rows (pair, 2) -> (2, pair)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split rules llama.cpp keys by `tokenizer.ggml.pre`; other names get GPT-2's."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3"):
        split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return byte_level


def read_gguf(
    path: str | Path, keep_quantized: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor | RawQuant], Tokenizer]:
    f = GGUFFile(path)
    cfg = f.config()
    return cfg, f.weights(cfg, keep_quantized), f.tokenizer(f.path.stem)
