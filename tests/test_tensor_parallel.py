"""Tensor parallelism on the CPU over gloo, on a tiny random Llama (4 query heads, 2 KV heads): TP=2 gives TP=1's
greedy tokens in float32, every rank's record reaches the controller and /metrics, an OOM on rank 1 alone is
recovered on both ranks with every request completed exactly once, and a rank that dies stops the engine and
the server answers 503."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.factory import build_engine
from engine.serving.app import create_app
from engine.serving.async_engine import AsyncEngine
from engine.serving.context import AppContext
from telemetry.metrics import Metrics
from telemetry.record import StepRecord
from tests.fixtures_llama import build_tiny_llama
from tests.inproc_server import serve_in_thread
from tests.test_server_errors import assert_error

PROMPTS = [[5 + i, 17, 33 + i, 40, 9] * (i + 1) for i in range(4)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_tp")).hf_dir


def engine_at(model: Path, size: int, **overrides: object) -> LLMEngine:
    return build_engine(EngineConfig(model=str(model), dtype="float32", tensor_parallel_size=size, **overrides))


def close(engine: LLMEngine) -> None:
    if (stop := getattr(engine.backend, "close", None)) is not None:
        stop()


def generate(engine: LLMEngine) -> tuple[dict[str, list[int]], Counter[str]]:
    """Every request's greedy tokens, and how many times each finished."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    finished: Counter[str] = Counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            finished[out.request_id] += out.finish_reason is not None
    return tokens, finished


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> dict[str, list[int]]:
    return generate(engine_at(tiny_dir, 1))[0]


@pytest.fixture(scope="module")
def tp2(tiny_dir: Path) -> Iterator[tuple[LLMEngine, list[StepRecord]]]:
    engine = engine_at(tiny_dir, 2)
    records: list[StepRecord] = []
    engine.step_listeners.append(lambda record, _batch: records.append(record))
    yield engine, records
    close(engine)


def test_tp2_greedy_tokens_equal_tp1(tp2: tuple[LLMEngine, list[StepRecord]], reference: dict) -> None:
    engine, _ = tp2
    tokens, finished = generate(engine)
    assert tokens == reference
    assert set(finished.values()) == {1}


def test_every_ranks_record_reaches_the_controller_and_metrics(tp2: tuple[LLMEngine, list[StepRecord]]) -> None:
    engine, records = tp2
    if not records:
        generate(engine)
    last = records[-1]
    assert [r.rank for r in last.ranks] == [0, 1]
    assert all(r.kv_blocks == engine.allocator.num_blocks and r.kv_block_bytes > 0 for r in last.ranks)
    # rank 1 holds no LM head (the tiny model's is not tied): its idle footprint is the smaller one
    assert last.ranks[1].memory.idle_baseline < last.ranks[0].memory.idle_baseline
    state = engine.policy.state()["ranks"]
    assert [r["rank"] for r in state] == [0, 1]
    assert sum(r["binding"] for r in state) == 1
    metrics = Metrics("tiny")
    metrics.observe_step(last)
    text = metrics.exposition().decode()
    for rank in ("0", "1"):
        assert f'headroom_rank_idle_bytes{{model_name="tiny",rank="{rank}"}}' in text


def test_oom_on_rank_1_only_is_recovered_on_both_ranks(tiny_dir: Path, reference: dict) -> None:
    engine = engine_at(tiny_dir, 2, inject_oom_rate=0.3, inject_oom_rank=1)
    try:
        tokens, finished = generate(engine)
    finally:
        close(engine)
    assert engine.ooms > 0
    assert engine.ooms_recovered == engine.ooms
    assert engine.healthy
    assert tokens == reference  # every request completed, with the tokens it gets without faults
    assert finished == Counter({rid: 1 for rid in reference})  # each exactly once


def test_a_rank_that_dies_ends_the_engine_with_503s_not_a_hang(tiny_dir: Path) -> None:
    engine = engine_at(tiny_dir, 2)
    backend = engine.backend
    server = AsyncEngine(engine, max_waiting=8)
    app = create_app(AppContext(server, "tiny", backend.tokenizer, vocab_size=backend.vocab_size))
    try:
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
            body = {"prompt": PROMPTS[0], "max_tokens": 4}
            assert http.post("/v1/completions", json=body).status_code == 200
            worker = backend._procs[0]
            worker.kill()
            worker.join()
            start = time.monotonic()
            assert_error(http.post("/v1/completions", json=body), 503)
            assert time.monotonic() - start < 10  # an error, not a hang
            assert_error(http.get("/health"), 503, code="engine_dead")
            assert_error(http.post("/v1/completions", json=body), 503, code="engine_dead")
        assert not engine.healthy
        assert "tensor parallel group lost" in (backend.dead or "")
    finally:
        close(engine)


def test_every_ranks_kv_shard_follows_a_pool_resize(tp2: tuple[LLMEngine, list[StepRecord]], reference: dict) -> None:
    """A resize (what the controller's pool sizing does between steps) reaches every rank; the requests then
    run as on one process. The twin's tests cover the pool the controller sizes by the tightest rank."""
    engine, _ = tp2
    for target in (engine.allocator.num_blocks // 2, engine.allocator.num_blocks + 64):
        plan = engine.resize_kv_pool(target)
        assert plan is not None
        assert [r.kv_blocks for r in engine.backend.rank_samples()] == [plan.num_blocks] * 2
        assert generate(engine)[0] == reference
