"""One rule for max_tokens=None (engine/core/llm_engine.py default_max_tokens): up to the context, but never
more than the whole KV pool holds. The offline LLM and the server resolve it the same way for the same prompt."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from controller.limits import Limits
from controller.policy import StaticPolicy
from engine.baselines.seed import FixedPolicy
from engine.core.llm_engine import LLMEngine, RequestError, default_max_tokens
from engine.core.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model.standin_tokenizer import StandInTokenizer
from engine.serving.app import create_app
from engine.serving.async_engine import AsyncEngine
from engine.serving.context import AppContext
from tests.fake_backend import FakeBackend

NUM_BLOCKS, BLOCK_SIZE, CONTEXT = 16, 4, 512  # a 64-token pool under a 512-token context: the pool binds


def core() -> LLMEngine:
    backend = FakeBackend(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=CONTEXT, eos=-1)
    return LLMEngine(backend, StaticPolicy(Limits()))  # the production scheduler, no baseline's rules


def test_the_offline_llm_and_the_server_resolve_the_same_default_max_tokens() -> None:
    tokenizer, prompt = StandInTokenizer(), "abcdefghijkl"
    ids = tokenizer.encode(prompt)
    expected = default_max_tokens(len(ids), CONTEXT, NUM_BLOCKS * BLOCK_SIZE)
    assert expected == NUM_BLOCKS * BLOCK_SIZE - len(ids) < CONTEXT - len(ids)
    offline = LLM(engine=core()).generate([ids], SamplingParams(max_tokens=None, ignore_eos=True))[0]
    ctx = AppContext(AsyncEngine(core(), tokenizer=tokenizer), model_name="fake", tokenizer=tokenizer)
    with TestClient(create_app(ctx)) as client:
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert len(offline.token_ids) == r.json()["usage"]["completion_tokens"] == expected
    assert offline.finish_reason == r.json()["choices"][0]["finish_reason"] == "length"


def test_a_request_that_fills_the_pool_is_served_under_a_scheduler_that_reserves_extra_slots() -> None:
    """The seed's rules reserve one slot past a request's tokens: the default leaves room for it, and an
    explicit max_tokens that would need the slot too is refused at arrival instead of waiting forever."""
    backend = FakeBackend(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=CONTEXT, eos=-1)
    engine = LLMEngine(backend, FixedPolicy())
    ids = list(range(1, 13))
    out = LLM(engine=engine).generate([ids], SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == NUM_BLOCKS * BLOCK_SIZE - len(ids) - 1
    with pytest.raises(RequestError, match="whole KV cache"):
        engine.add_request("full", ids, SamplingParams(max_tokens=NUM_BLOCKS * BLOCK_SIZE - len(ids)))
