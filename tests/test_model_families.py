"""Every family Headroom serves, against transformers' own implementation of it (tests/tiny_families.py: a tiny
random model made with transformers' classes, float32):

- through the server `headroom serve` builds (its flags, its app), greedy completions give transformers'
  `generate` tokens for 32 tokens, for one request alone and for eight at once;
- the model's logits through the paged cache match transformers' on the C++ kernels and in plain torch;
- the dense families sharded over two ranks give one device's logits;
- an architecture Headroom does not serve is refused at start-up with the list of those it does.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from engine.backends.torch_backend import TorchBackend
from engine.model.attention import build_attention_metadata
from engine.model.families import FAMILIES as SERVED
from engine.model.families import UnsupportedModelError
from engine.model.loaders.hf import read_config
from engine.serving.cli import add_serve_args, configs
from engine.serving.launch import build_app
from tests.inproc_server import serve_in_thread
from tests.kernel_build import require_cpu_kernels
from tests.test_tensor_parallel_shards import prefill_batch, sharded_logits
from tests.tiny_families import FAMILIES, TinyFamily, build, greedy

TOKENS = 32
# eight prompts of different lengths, some past the sliding window, as token ids of the tiny vocabulary
PROMPTS = [[5 + (7 * i + 3 * j) % 300 for j in range(4 + 5 * i)] for i in range(8)]
DENSE = [name for name in FAMILIES if name != "qwen3_moe"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyFamily:
    return build(request.param, tmp_path_factory.mktemp(request.param))


@contextmanager
def served(model: Path, *flags: str) -> Iterator[str]:
    """The app `headroom serve --model <model> <flags>` builds, on a loopback port."""
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--model", str(model), "--dtype", "float32", "--device", "cpu", *flags])
    with serve_in_thread(build_app(*configs(parser, args))) as url:
        yield url


def complete(url: str, prompt: list[int]) -> list[int]:
    body = {
        "model": "m", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def test_served_greedy_tokens_are_transformers_alone_and_in_a_batch_of_8(family: TinyFamily) -> None:
    want = [greedy(family, p, TOKENS) for p in PROMPTS]
    with served(family.hf_dir, "--served-model-name", "m") as url:
        alone = complete(url, PROMPTS[-1])
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            batched = list(pool.map(lambda p: complete(url, p), PROMPTS))
        state = httpx.get(url + "/controller/state", timeout=30).json()
    assert alone == want[-1]
    assert batched == want
    assert state["policy"] == "adaptive" and state["estimator"]["samples"] > 0  # it learned this model's step peaks


@pytest.mark.parametrize("attention", ["cpu", "sdpa"])  # the C++ kernels, and the model in plain torch
@torch.inference_mode()
def test_logits_through_the_paged_cache_are_transformers(family: TinyFamily, attention: str) -> None:
    if attention == "cpu":
        require_cpu_kernels()
    backend = TorchBackend(str(family.hf_dir), dtype="float32", device="cpu", num_blocks=16, attention=attention)
    ids = PROMPTS[-1]
    table = list(range(16))[::-1]  # blocks out of order, so the paging is exercised
    meta = build_attention_metadata([(0, len(ids), table)], backend.block_size, "cpu", attention)
    hidden = backend.model(torch.tensor(ids), torch.arange(len(ids)), backend.kv_caches, meta)
    want = family.model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(backend.model.compute_logits(hidden), want, atol=5e-5, rtol=5e-5)


def test_dense_families_sharded_over_two_ranks_give_one_devices_logits(family: TinyFamily) -> None:
    if family.name not in DENSE:
        pytest.skip("tensor parallelism shards the dense families")
    one = TorchBackend(str(family.hf_dir), dtype="float32", num_blocks=8, model_cache=False)
    want = one.model.compute_logits(one.forward(prefill_batch()))
    torch.testing.assert_close(sharded_logits(str(family.hf_dir), 2), want, rtol=1e-4, atol=1e-4)


def test_an_unknown_architecture_is_refused_with_the_served_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], "hidden_size": 8}))
    with pytest.raises(UnsupportedModelError) as refused:
        read_config(tmp_path)
    assert "FalconForCausalLM" in str(refused.value)
    assert all(name in str(refused.value) for name in SERVED)
