"""GGUFs of every family Headroom serves, written as llama.cpp's converter writes them (tests/gguf_families.py),
against transformers' own model of the family (tests/tiny_families.py, float32):

- from an F32 GGUF the config is the one the HF checkpoint gives (engine/model/families.py), the prefill
  logits through the paged cache are transformers', and through the server `headroom serve` builds greedy
  completions give transformers' tokens for 32 tokens, alone and eight at once;
- from a Q8_0 GGUF the matrices run on their blocks (an MoE layer's experts dequantized), and transformers'
  greedy tokens stay the quantized model's (`test_a_q8_0_gguf_runs_quantized_and_keeps_the_greedy_tokens`
  says how close);
- an architecture Headroom does not serve is refused with the list of those it does;
- Qwen's pre-tokenizer (`tokenizer.ggml.pre` qwen2) splits text as Qwen2's tokenizer.json does.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import pytest
import torch
from tokenizers import Regex, pre_tokenizers
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from engine.backends.torch_backend import TorchBackend
from engine.model.attention import build_attention_metadata
from engine.model.families import FAMILIES as SERVED
from engine.model.families import UnsupportedModelError
from engine.model.loaders import load
from engine.model.loaders.gguf import ARCHITECTURES, GGUFFile, pre_tokenizer
from engine.model.loaders.hf import read_config
from tests.fixtures_llama import write
from tests.gguf_families import build_as_gguf, save_family_gguf
from tests.kernel_build import require_cpu_kernels
from tests.test_model_families import PROMPTS, complete, served
from tests.test_model_families import TOKENS as SERVED_TOKENS
from tests.tiny_families import FAMILIES, TinyFamily, greedy

PROMPT = [5 + (7 * j) % 300 for j in range(30)]  # past the sliding window
TOKENS, AGREEING = 16, 12  # of transformers' greedy tokens, those the Q8_0 model must pick too


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyFamily:
    return build_as_gguf(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def f32_gguf(family: TinyFamily) -> Path:
    path = family.hf_dir.parent / "f32.gguf"
    save_family_gguf(family, path, gguf.GGMLQuantizationType.F32)
    return path


def test_the_config_is_the_hf_checkpoints(family: TinyFamily, f32_gguf: Path) -> None:
    got, want = GGUFFile(f32_gguf).config(), read_config(family.hf_dir)
    if family.name == "mistral":
        want.architecture = "LlamaForCausalLM"  # the converter writes Mistral as llama
    if family.name == "phi3":  # the converter stores the longrope attention factor HF derives from the lengths
        assert got.rope_scaling.pop("attention_factor") == pytest.approx(math.sqrt(1 + math.log(2) / math.log(256)))
    assert got == want


@torch.inference_mode()
def test_prefill_logits_are_transformers(family: TinyFamily, f32_gguf: Path) -> None:
    backend = TorchBackend(load(str(f32_gguf), torch.float32), dtype="float32", num_blocks=8, attention="sdpa")
    table = list(range(8))[::-1]  # blocks out of order, so the paging is exercised
    meta = build_attention_metadata([(0, len(PROMPT), table)], backend.block_size, "cpu", "sdpa")
    hidden = backend.model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), backend.kv_caches, meta)
    want = family.model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(backend.model.compute_logits(hidden), want, atol=1e-4, rtol=1e-4)


def test_served_greedy_tokens_are_transformers_alone_and_in_a_batch_of_8(family: TinyFamily, f32_gguf: Path) -> None:
    want = [greedy(family, p, SERVED_TOKENS) for p in PROMPTS]
    with served(f32_gguf, "--served-model-name", "m") as url:
        alone = complete(url, PROMPTS[-1])
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            batched = list(pool.map(lambda p: complete(url, p), PROMPTS))
    assert alone == want[-1]
    assert batched == want


@torch.inference_mode()
def test_a_q8_0_gguf_runs_quantized_and_keeps_the_greedy_tokens(family: TinyFamily) -> None:
    """Q8_0 weights, and the kernel's int8 activations, move these tiny models' logits by a few percent, enough to
    swap two near-tied tokens. So transformers' greedy continuation is fed back step by step through the cache
    (one swap does not derail the rest): at every step its token must be in the quantized model's top 3, and its
    top 1 at AGREEING steps of TOKENS. A wrong name, permute or norm leaves the tokens far down the ranking."""
    require_cpu_kernels()
    path = family.hf_dir.parent / "q8_0.gguf"
    save_family_gguf(family, path, gguf.GGMLQuantizationType.Q8_0)
    backend = TorchBackend(str(path), dtype="float32", quantization="auto", num_blocks=8, attention="sdpa")
    assert backend.model.quantized and backend.model.embed.dtype == torch.uint8
    ranks = forced_ranks(backend, PROMPT, greedy(family, PROMPT, TOKENS))
    assert max(ranks) < 3 and ranks.count(0) >= AGREEING, ranks


def forced_ranks(backend: TorchBackend, prompt: list[int], continuation: list[int]) -> list[int]:
    """The rank of each token of `continuation` in the model's logits after the tokens before it: the prompt's
    prefill, then one decode step a token, through the cache."""
    ids, table, start, ranks = list(prompt), list(range(backend.num_blocks)), 0, []
    for token in continuation:
        meta = build_attention_metadata([(start, len(ids) - start, table)], backend.block_size, "cpu", "sdpa")
        hidden = backend.model(torch.tensor(ids[start:]), torch.arange(start, len(ids)), backend.kv_caches, meta)
        logits = backend.model.compute_logits(hidden[-1:])[0]
        ranks.append(int((logits > logits[token]).sum()))
        start = len(ids)
        ids.append(token)
    return ranks


def test_an_unknown_architecture_is_refused_with_the_served_ones(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    w.add_block_count(1)
    write(w)
    with pytest.raises(UnsupportedModelError) as refused:
        GGUFFile(tmp_path / "falcon.gguf")
    assert "falcon" in str(refused.value)
    assert all(name in str(refused.value) for name in [*SERVED, *ARCHITECTURES])


def test_qwen2_splits_as_its_tokenizer_json() -> None:
    """`tokenizer.ggml.pre` qwen2 (Qwen2, Qwen2.5, Qwen3) splits as the regex of transformers' Qwen2 tokenizer."""
    qwen2 = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    text = "It's 2024: 12345 apples,\n\n  ünïcödé 東京 DON'T\tstop 🙂"
    assert pre_tokenizer("qwen2").pre_tokenize_str(text) == qwen2.pre_tokenize_str(text)
    assert [p for p, _ in pre_tokenizer("qwen2").pre_tokenize_str("12345")] == list("12345")
