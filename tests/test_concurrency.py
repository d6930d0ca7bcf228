"""The controller and metrics endpoints stay correct while the engine thread works: `/metrics`,
`GET /controller/state` and `PATCH /controller/config` are hammered during a load of concurrent
completions (some of them rejected at arrival by the controller, which logs each rejection), and no
answer may be a 5xx.

The backend is the paged fake with a memory probe whose peak grows linearly with the step's work, so the
adaptive estimator trains within a few steps and then rejects requests whose final decode cannot fit.
The policy's decision log yields the GIL between the entries a reader iterates over, so that a reader on
another thread than the engine's is caught in seconds (without it the same race needs hours of load).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from controller.adaptive import DECISIONS_KEPT, AdaptivePolicy
from engine.core.batch import ModelOutput, SchedulerOutput
from engine.core.llm_engine import LLMEngine
from engine.model.standin_tokenizer import StandInTokenizer
from engine.serving.app import create_app
from engine.serving.async_engine import AsyncEngine
from engine.serving.context import AppContext
from telemetry.metrics import Metrics
from telemetry.probes.null import NullProbe
from telemetry.record import MemorySample, StepShape
from telemetry.units import MIB
from tests.fake_backend import FakeBackend
from tests.inproc_server import serve_in_thread

IDLE = 100 * MIB
CAPACITY = IDLE + 1000 * MIB  # ~40 short decodes fit a step; a decode at context 1208 never does
PROMPT = list(range(1, 9))
MAX_TOKENS = 64
TOO_LONG = 2000  # max_tokens whose final decode the trained controller predicts far beyond all free memory
REQUESTS = 32
TOO_LONG_REQUESTS = 400
CONCURRENCY = 32  # clients sending the requests the controller rejects
STATE_SCRAPERS = 2


class LinearMemoryProbe(NullProbe):
    """Peak above idle = 1 MiB per prefill token and per token of context: a plant the estimator learns."""

    def measure(self, shape: StepShape) -> MemorySample:
        peak = IDLE + MIB * (shape.prefill_tokens + shape.sum_context)
        return MemorySample(peak_allocated=peak, idle_baseline=IDLE, capacity=CAPACITY)


class MeteredBackend(FakeBackend):
    def __init__(self) -> None:
        super().__init__(num_blocks=512, block_size=4, max_model_len=2048)
        self.probe = LinearMemoryProbe(CAPACITY, IDLE)

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        self.steps.clear()  # keep no history: the test runs thousands of steps
        return super().execute(batch)


class YieldingDeque(deque):
    """A deque whose iteration lets other threads run between items: widens any read-vs-write race."""

    def __iter__(self) -> Iterator[Any]:
        for item in super().__iter__():
            time.sleep(0)
            yield item


async def _completion(h: httpx.AsyncClient, i: int) -> tuple[int, int | None]:
    """(status, completion tokens or None); every fourth request streams."""
    stream = i % 4 == 0
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream}
    if not stream:
        r = await h.post("/v1/completions", json=body)
        return r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200 else None
    body["stream_options"] = {"include_usage": True}
    async with h.stream("POST", "/v1/completions", json=body) as r:
        tokens = None
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"usage":{' in line:
                tokens = httpx.Response(200, content=line[6:]).json()["usage"]["completion_tokens"]
        return r.status_code, tokens


async def _hammer(h: httpx.AsyncClient, done: asyncio.Event, statuses: Counter, kind: str) -> None:
    """Scrape or reconfigure the controller in a loop until the load is done."""
    i = 0
    while not done.is_set():
        i += 1
        if kind == "state":
            r = await h.get("/controller/state", params={"steps": 5})
        elif kind == "metrics":
            r = await h.get("/metrics")
        elif i % 2:
            r = await h.patch("/controller/config", json={"margin_floor_mib": 16.0 + i % 4})
        else:
            r = await h.patch("/controller/config", json={"margin_floor_mib": -1})
            assert r.status_code >= 500 or r.status_code == 400, r.text
        statuses[kind, r.status_code] += 1


async def _load(url: str) -> tuple[list[tuple[int, int | None]], list[int], Counter]:
    limits = httpx.Limits(max_connections=REQUESTS + CONCURRENCY + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as h:
        # Train the estimator first, so that the long requests are rejected at arrival, not served.
        for _ in range(3):
            assert (await h.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})).status_code == 200
        done, statuses = asyncio.Event(), Counter()
        kinds = [*["state"] * STATE_SCRAPERS, "metrics", "config"]
        hammers = [asyncio.create_task(_hammer(h, done, statuses, kind)) for kind in kinds]
        gate = asyncio.Semaphore(CONCURRENCY)

        async def too_long() -> int:
            async with gate:
                body = {"prompt": PROMPT, "max_tokens": TOO_LONG, "ignore_eos": True}
                return (await h.post("/v1/completions", json=body)).status_code

        try:
            # All served requests run at once, more than memory admits per step, so every step defers
            # decodes (and logs why) while the rejected ones arrive.
            served = asyncio.gather(*(_completion(h, i) for i in range(REQUESTS)))
            rejected = await asyncio.gather(*(too_long() for _ in range(TOO_LONG_REQUESTS)))
            results = await served
        finally:
            done.set()
            await asyncio.gather(*hammers)
    return results, rejected, statuses


@pytest.mark.timeout(90)
def test_state_metrics_and_config_under_load_never_5xx() -> None:
    policy = AdaptivePolicy()
    policy.decisions = YieldingDeque(policy.decisions, maxlen=DECISIONS_KEPT)
    engine = AsyncEngine(LLMEngine(MeteredBackend(), policy), max_waiting=REQUESTS + CONCURRENCY)
    ctx = AppContext(engine, model_name="fake", tokenizer=StandInTokenizer(), metrics=Metrics("fake"), vocab_size=1000)
    app = create_app(ctx)
    with serve_in_thread(app) as url:
        results, rejected, statuses = asyncio.run(_load(url))
        state = httpx.get(url + "/controller/state", timeout=30).json()
    server_errors = {k: n for k, n in statuses.items() if k[1] >= 500}
    assert not server_errors, f"controller/metrics answers by status: {dict(statuses)}"
    assert results == [(200, MAX_TOKENS)] * REQUESTS
    assert set(rejected) <= {200, 400} and rejected.count(400) > TOO_LONG_REQUESTS // 2, Counter(rejected)
    assert state["counters"]["rejected_too_long"] == rejected.count(400)
    assert state["engine"]["kv_blocks_used"] == 0 and state["engine"]["num_running"] == 0
