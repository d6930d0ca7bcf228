"""GGUF (llama.cpp) files of the families Headroom serves: the config from `<arch>.*` metadata, read as llama.cpp
reads it, into the fields engine/model/families.py derives from an HF config.json; the weights under their HF
names and in HF's layout (dequantized, or their Q8_0/Q4_0/Q4_1 blocks kept as they ship: engine/model/quant.py);
the tokenizer rebuilt from `tokenizer.ggml.*` (byte-level BPE, or SentencePiece BPE).

What llama.cpp's converter (convert_hf_to_gguf.py) changes, and this undoes: q/k rows permuted, for `llama`
only; an MoE layer's experts stacked into one 3-D tensor per projection. Gemma's norms are stored as 1 + w,
which is what engine/model/llama.py multiplies by, so they stay as they are. What a GGUF does not say, and is
taken as llama.cpp takes it: Mistral is written as `llama` without its sliding window (so it runs with full
attention: exact within the window, not past it); Gemma scales queries by head_dim (hidden / heads in the 27B
models), not query_pre_attn_scalar; Gemma 2 slides every other layer from the first, Gemma 3 all but every
sixth, its local layers on a RoPE base of 10000 unless the file names one; Qwen3-MoE renormalizes the chosen
experts' weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.model.families import GEMMA, UnsupportedModelError, family_traits, unsupported
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
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 1, 3, 4
SPACE = "\u2581"  # SentencePiece's space
# the regexes a pre-tokenizer splits by before the byte-level step, as the models' tokenizer.json write them
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one by one
# `tokenizer.ggml.pre` -> its split regex, for the names llama.cpp (src/llama-vocab.cpp) gives these rules
SPLITS = {
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
}

# `general.architecture` -> the HF architecture it is (engine/model/families.py); Mistral is written as llama
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# llama.cpp's sliding-window layer pattern n: layer i slides if n == 0 or i % n < n - 1 (llama_hparams
# set_swa_pattern). llama.cpp ignores Phi-3's window; HF's Phi-3 slides every layer, and so does Headroom.
SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "phi3": 0}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # where llama.cpp scales queries by hidden / heads
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}
# where a family's HF name differs: Gemma's `ffn_norm` is the norm before the MLP (its post_attention_layernorm
# is the one after attention), Phi-3's `ffn_up` holds gate and up, fused as HF's gate_up_proj
_FAMILY_NAMES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}  # config, not weights


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
        self.arch = self.get("general.architecture")
        if self.arch not in ARCHITECTURES:
            listed = ", ".join(ARCHITECTURES)
            raise UnsupportedModelError(f"{self.path.name}: {unsupported([self.arch])} (as GGUF: {listed})")
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.names = _LAYER_NAMES | _FAMILY_NAMES.get(self.arch, {})

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def get_float(self, key: str, default: float | None) -> float | None:
        """Float metadata is float32: `_decimal` gives 1e-05, not 9.99e-06."""
        value = self.get(key)
        return default if value is None else _decimal(value)

    def meta(self, key: str, default: Any = None) -> Any:
        """The architecture's own key (`qwen2.block_count` for `block_count`)."""
        return self.get(f"{self.arch}.{key}", default)

    def meta_float(self, key: str, default: float | None) -> float | None:
        return self.get_float(f"{self.arch}.{key}", default)

    def config(self) -> ModelConfig:
        """The fields engine/model/families.py `config_from_hf` sets, from what llama.cpp reads."""
        arch, hidden, heads = self.arch, self.meta("embedding_length"), self.meta("attention.head_count")
        layers, head_dim = self.meta("block_count"), self.meta("attention.key_length", hidden // heads)
        if self.meta("rope.dimension_count", head_dim) != head_dim:
            raise UnsupportedModelError(f"{self.path.name}: partial rotary embeddings are not supported")
        experts = self.meta("expert_count", 0)
        if experts and arch != "qwen3moe":
            raise UnsupportedModelError(f"{self.path.name}: a mixture of experts is supported in qwen3moe only")
        window, sliding = self._sliding_layers(layers)
        gemma = ARCHITECTURES[arch] in GEMMA
        return ModelConfig(
            vocab_size=int(self.tensors["token_embd.weight"].shape[1]),
            hidden_size=hidden,
            intermediate_size=self.meta("feed_forward_length"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=self.meta("attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=self.meta_float("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=self.meta_float("rope.freq_base", 10000.0),
            rope_scaling=self._rope_scaling(),
            max_position_embeddings=self.meta("context_length", 2048),
            tie_word_embeddings="output.weight" not in self.tensors,
            **family_traits(ARCHITECTURES[arch], hidden),
            activation="gelu_tanh" if gemma else "silu",
            attn_scale=self._query_scale(hidden // heads, head_dim, layers) if gemma else None,
            attn_softcap=self.meta_float("attn_logit_softcapping", 50.0) if arch == "gemma2" else None,
            final_softcap=self.meta_float("final_logit_softcapping", 30.0 if arch == "gemma2" else None),
            sliding_window=window,
            sliding_layers=sliding,
            local_rope_theta=self.meta_float("rope.freq_base_swa", 10000.0) if arch == "gemma3" else None,
            num_experts=experts,
            experts_per_token=self.meta("expert_used_count", 0),
            moe_intermediate_size=self.meta("expert_feed_forward_length", 0),
            norm_topk_prob=experts > 0,  # llama.cpp's qwen3moe always renormalizes
            moe_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in self.tensors],
        )

    def _query_scale(self, hidden_per_head: int, head_dim: int, layers: int) -> float:
        """Gemma's, as llama.cpp sets it (a GGUF has no query_pre_attn_scalar): one over the root of head_dim, or of
        hidden / heads in the 27B models, which llama.cpp tells apart by their layer count."""
        return (hidden_per_head if layers == GEMMA_27B_LAYERS[self.arch] else head_dim) ** -0.5

    def _sliding_layers(self, layers: int) -> tuple[int | None, list[int]]:
        """(window, the layers that slide), by llama.cpp's rule for the family (SWA_PATTERNS); Gemma 2's window
        is 4096 where the file has none. A zero window, or a family without a rule, slides nowhere."""
        pattern = SWA_PATTERNS.get(self.arch)
        window = self.meta("attention.sliding_window", 4096 if self.arch == "gemma2" else 0)
        if pattern is None or not window:
            return None, []
        return window, [i for i in range(layers) if pattern == 0 or i % pattern < pattern - 1]

    def _rope_scaling(self) -> dict[str, Any] | None:
        """engine/model/rope.py's scaling: Llama 3's as the divisors the converter stores (`rope_freqs`), Phi-3's
        longrope as its two factor tensors, linear from the metadata. UnsupportedModelError for others (YaRN)."""
        if "rope_freqs.weight" in self.tensors:
            return {"rope_type": "freq_factors", "factors": [float(x) for x in self.tensors["rope_freqs.weight"].data]}
        if "rope_factors_long.weight" in self.tensors:
            return {
                "rope_type": "longrope",
                "short_factor": [_decimal(x) for x in self.tensors["rope_factors_short.weight"].data],
                "long_factor": [_decimal(x) for x in self.tensors["rope_factors_long.weight"].data],
                "original_max_position_embeddings": self.meta("rope.scaling.original_context_length"),
                "attention_factor": self.meta_float("rope.scaling.attn_factor", None),
            }
        kind = self.meta("rope.scaling.type", "none")
        if kind == "linear":
            return {"rope_type": "linear", "factor": self.meta_float("rope.scaling.factor", 1.0)}
        if kind != "none":
            raise UnsupportedModelError(f"{self.path.name}: rope scaling {kind!r} is not supported")
        return None

    def weights(self, cfg: ModelConfig, keep_quantized: bool = False) -> dict[str, torch.Tensor | RawQuant]:
        """HF-named float32 tensors; with `keep_quantized`, the Q8_0/Q4_0/Q4_1 matrices as RawQuant (their
        blocks, rows permuted as below, nothing dequantized). For `llama`, llama.cpp's converter permutes q/k
        rows so that each head's rotary pairs are adjacent (GPT-J style); `_unpermute` restores HF's rotate_half
        order. An MoE layer's stacked experts come back as HF's one weight per expert, dequantized (the model
        keeps experts in floats: engine/model/checkpoint.py)."""
        out: dict[str, torch.Tensor | RawQuant] = {}
        for t in self.reader.tensors:
            if t.name in ROPE_TENSORS:
                continue
            if t.tensor_type not in SUPPORTED_TYPES:
                kinds = ", ".join(sorted(k.name for k in SUPPORTED_TYPES))
                raise UnsupportedModelError(f"{self.path.name}: tensor {t.name} is {t.tensor_type.name}, not {kinds}")
            shape = [int(n) for n in reversed(t.shape)]
            kind = t.tensor_type.name.lower()
            if keep_quantized and kind in KINDS and len(shape) == 2:
                array = np.asarray(t.data).reshape(shape[0], -1)  # [rows, row bytes], still the mapped file
            else:  # F32 tensors come back as read-only views of the mapped file: copy those only
                array = np.require(dequantize(t.data, t.tensor_type), np.float32, ["C", "W"]).reshape(shape)
            name = self._hf_name(t.name)
            if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                array = _unpermute(array, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
            if array.ndim == 3:
                out.update({name.format(j): torch.from_numpy(expert) for j, expert in enumerate(array)})
            else:
                out[name] = RawQuant(array, kind) if array.dtype == np.uint8 else torch.from_numpy(array)
        return out

    def _hf_name(self, name: str) -> str:
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        blk, layer, part, suffix = name.split(".")
        if blk != "blk" or part not in self.names:
            raise ValueError(f"{self.path.name}: unexpected GGUF tensor {name}")
        return f"model.layers.{layer}.{self.names[part]}.{suffix}"

    def tokenizer(self, name: str) -> Tokenizer:
        tokens: list[str] = self.get("tokenizer.ggml.tokens")
        kind = self.get("tokenizer.ggml.model")
        if kind == "gpt2":
            bpe = self._byte_level_bpe(tokens)
        elif kind == "llama":
            bpe = self._sentencepiece_bpe(tokens)
        else:
            raise UnsupportedModelError(
                f"{self.path.name}: tokenizer model {kind!r} is not supported, only byte-level BPE (gpt2) and "
                "SentencePiece BPE (llama)"
            )
        types = self.get("tokenizer.ggml.token_type") or []
        special = [tokens[i] for i, k in enumerate(types) if k in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
        bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        eos = self.get("tokenizer.ggml.eos_token_id")
        eot = self.get("tokenizer.ggml.eot_token_id")
        bos = self.get("tokenizer.ggml.bos_token_id")
        # what llama.cpp adds (its converters write these keys from the HF tokenizer's post-processor; a
        # SentencePiece file that has no key gets BOS, as llama.cpp gives it)
        bpe.post_processor = special_tokens_processor(
            bpe,
            bos if self.get("tokenizer.ggml.add_bos_token", kind == "llama") else None,
            eos if self.get("tokenizer.ggml.add_eos_token", False) else None,
        )
        return Tokenizer(
            bpe,
            name=name,
            eos_token_ids={i for i in (eos, eot) if i is not None},
            bos_token_id=bos,
            chat_template=self.get("tokenizer.chat_template"),
        )

    def _byte_level_bpe(self, tokens: list[str]) -> HFTokenizer:
        merges = [tuple(m.split(" ", 1)) for m in self.get("tokenizer.ggml.merges")]
        bpe = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
        bpe.pre_tokenizer = pre_tokenizer(self.get("tokenizer.ggml.pre", "default"))
        bpe.decoder = decoders.ByteLevel()
        return bpe

    def _sentencepiece_bpe(self, tokens: list[str]) -> HFTokenizer:
        """SentencePiece BPE as llama.cpp's SPM tokenizer runs it (Llama 2, Mistral, Gemma, Phi-3 files): spaces as
        `▁`, one more before the text and after each special token unless `add_space_prefix` is false, the
        adjacent pair whose merge scores highest merged first, and a character outside the vocabulary as its
        UTF-8 bytes (`<0xNN>` tokens). Gemma's files, as transformers' GGUF reader found, spell runs of spaces
        with spaces and rank merges by position, not score."""
        scores: list[float] = self.get("tokenizer.ggml.scores")
        if self.arch.startswith("gemma"):
            tokens = [SPACE * len(t) if len(t) > 1 and not t.strip(" ") else t for t in tokens]
            scores = [-float(i) for i in range(len(tokens))]
        types = self.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens)
        pieces = {t: i for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k == TOKEN_TYPE_NORMAL}
        merges = sorted(
            ((-scores[i], len(t[:cut]), t[:cut], t[cut:]) for t, i in pieces.items() for cut in range(1, len(t))
             if t[:cut] in pieces and t[cut:] in pieces),
        )  # fmt: skip
        unk = self.get("tokenizer.ggml.unknown_token_id")
        model = models.BPE(
            {t: i for i, t in enumerate(tokens)},
            [(left, right) for *_, left, right in merges],
            unk_token=None if unk is None else tokens[unk],
            fuse_unk=True,
            byte_fallback=True,
        )
        bpe = HFTokenizer(model)
        prefix = bool(self.get("tokenizer.ggml.add_space_prefix", True))
        bpe.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE)] * prefix + [normalizers.Replace(" ", SPACE)])
        bpe.decoder = decoders.Sequence(
            [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
            + [decoders.Strip(" ", 1, 0)] * prefix
        )
        return bpe


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert's `permute`: per head, rows (pair, 2) -> (2, pair)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split rules llama.cpp keys by `tokenizer.ggml.pre`; other names get GPT-2's."""
    if pre == "smollm":
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in SPLITS:
        split = pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _decimal(x: float) -> float:
    """A float32 as the shortest decimal that round-trips: the value the converter was given."""
    return float(str(np.float32(x)))


def read_gguf(
    path: str | Path, keep_quantized: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor | RawQuant], Tokenizer]:
    f = GGUFFile(path)
    cfg = f.config()
    return cfg, f.weights(cfg, keep_quantized), f.tokenizer(f.path.stem)
