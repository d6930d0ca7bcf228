"""A tiny random Llama saved both as an HF directory and as a GGUF file, with a small byte-level BPE
tokenizer trained on the spot: the loaders and the model are tested without any download."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TokenizerStyle:
    special_tokens: list[str]
    bos: str
    eos: str
    chat_template: str
    adds_bos: bool  # tokenizer.json's post-processor adds BOS, and the GGUF says tokenizer.ggml.add_bos_token


SMOL_STYLE = TokenizerStyle(SPECIAL_TOKENS, SPECIAL_TOKENS[BOS_ID], SPECIAL_TOKENS[EOS_ID], CHAT_TEMPLATE, False)
# Llama 3's: a TemplateProcessing post-processor puts <|begin_of_text|> before every encoded text, and the
# chat template writes it too (as {{ bos_token }}).
LLAMA3_STYLE = TokenizerStyle(
    ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "<|begin_of_text|>",
    "<|eot_id|>",
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    True,
)
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello world! How are you today? I am fine, thank you.",
    "Numbers like 12345 and 3.14159 appear in text, and so does ünïcödé, 東京 and emoji 🙂.",
    "def main():\n    print('hello')\n    return 0\n",
] * 20


@dataclass
class TinyLlama:
    hf_dir: Path
    gguf_path: Path
    config: dict
    weights: dict[str, torch.Tensor]  # HF names, float32, values exactly representable in fp16
    style: TokenizerStyle


def train_tokenizer(vocab_size: int = 320, style: TokenizerStyle = SMOL_STYLE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=style.special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if style.adds_bos:
        bos = (style.bos, tok.token_to_id(style.bos))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B:1", special_tokens=[bos]
        )
    return tok


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Large enough embeddings and head that greedy choices have clear margins."""
    g = torch.Generator().manual_seed(seed)
    d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    h, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape: int, std: float = 0.08) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * std).half().float()

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(d, generator=g)).half().float()

    w = {"model.embed_tokens.weight": rand(cfg["vocab_size"], d, std=0.5), "model.norm.weight": norm()}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rand(cfg["vocab_size"], d, std=0.5)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": rand(h * hd, d),
            p + "self_attn.k_proj.weight": rand(kvh * hd, d),
            p + "self_attn.v_proj.weight": rand(kvh * hd, d),
            p + "self_attn.o_proj.weight": rand(d, h * hd),
            p + "mlp.gate_proj.weight": rand(f, d),
            p + "mlp.up_proj.weight": rand(f, d),
            p + "mlp.down_proj.weight": rand(d, f),
        }
    return w


def save_hf(path: Path, cfg: dict, weights: dict[str, torch.Tensor], tok: Tokenizer, style: TokenizerStyle) -> None:
    """Two safetensors shards with an index, as large checkpoints are published."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **cfg}))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, shard in shards.items():
        save_file({n: weights[n].contiguous() for n in shard}, str(path / file))
    weight_map = {n: file for file, shard in shards.items() for n in shard}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": style.chat_template,
                "bos_token": style.bos,
                "eos_token": {"content": style.eos, "special": True},
            }
        )
    )


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert's `permute` of q/k rows: HF rotate_half pairs -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def save_gguf(
    path: Path,
    cfg: dict,
    weights: dict[str, torch.Tensor],
    tok: Tokenizer,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F16,
    style: TokenizerStyle = SMOL_STYLE,
) -> None:
    """Matrices in `qtype`, norms in F32, q/k permuted the way llama.cpp's converter does."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    add_tokenizer(w, tok, style)
    for name, t in weights.items():
        a = t.numpy()
        if name.endswith("q_proj.weight"):
            a = llama_cpp_permute(a, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            a = llama_cpp_permute(a, cfg["num_key_value_heads"])
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{GGUF_NAMES[module]}.{suffix}"
        add_weight(w, gname, a, qtype)
    write(w)


def add_tokenizer(w: gguf.GGUFWriter, tok: Tokenizer, style: TokenizerStyle) -> None:
    """`tokenizer.ggml.*` and the chat template, as llama.cpp's converter writes a byte-level BPE vocabulary
    (`default` split rules: the fixture's tokenizer is GPT-2's, which no llama.cpp pre-tokenizer hash names)."""
    vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in style.special_tokens else 1 for t, _ in vocab])
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.token_to_id(style.bos))
    w.add_eos_token_id(tok.token_to_id(style.eos))
    if style.adds_bos:
        w.add_add_bos_token(True)
    w.add_chat_template(style.chat_template)


def add_weight(w: gguf.GGUFWriter, name: str, a: np.ndarray, qtype: gguf.GGMLQuantizationType) -> None:
    """A tensor in the type llama.cpp's converter gives it in a `qtype` file: vectors, norms, biases and MoE routers
    in F32 (the converter never quantizes those), a matrix whose rows are not whole quantization blocks in F16,
    every other matrix in `qtype`."""
    f32 = a.ndim == 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or ".ffn_gate_inp." in name
    if f32 or qtype == gguf.GGMLQuantizationType.F32:
        w.add_tensor(name, a.astype(np.float32))
    elif qtype == gguf.GGMLQuantizationType.F16 or a.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        w.add_tensor(name, a.astype(np.float16))
    else:
        q = gguf.quants.quantize(a.astype(np.float32), qtype)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)


def write(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_config(vocab_size: int, tie: bool = False) -> dict:
    return {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": tie,
    }


def build_tiny_llama(
    root: Path,
    tie: bool = False,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F16,
    style: TokenizerStyle = SMOL_STYLE,
) -> TinyLlama:
    root.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(style=style)
    cfg = tiny_config(tok.get_vocab_size(with_added_tokens=True), tie)
    weights = random_weights(cfg)
    save_hf(root / "hf", cfg, weights, tok, style)
    save_gguf(root / "tiny.gguf", cfg, weights, tok, qtype, style)
    return TinyLlama(root / "hf", root / "tiny.gguf", cfg, weights, style)
