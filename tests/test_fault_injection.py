"""OOM recovery through the whole server: with 1% of steps failing, every request completes exactly once
with its exact token count, and /health never leaves 200."""

from __future__ import annotations

import asyncio
import random

import httpx

from tests.test_server import metric

N_REQUESTS = 1000
CONCURRENCY = 64


async def drive(url: str, model: str) -> tuple[list[tuple[int, int]], list[int]]:
    rng = random.Random(0)
    jobs = [(rng.randint(1, 600), rng.randint(1, 24)) for _ in range(N_REQUESTS)]
    results: list[tuple[int, int]] = []
    health: list[int] = []
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def worker() -> None:
            while not queue.empty():
                n_in, n_out = queue.get_nowait()
                body = {"model": model, "prompt": [5] * n_in, "max_tokens": n_out, "ignore_eos": True}
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                results.append((n_out, r.json()["usage"]["completion_tokens"]))

        async def watch(done: asyncio.Event) -> None:
            while not done.is_set():
                health.append((await client.get("/health")).status_code)
                await asyncio.sleep(0.05)

        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        done.set()
        await watcher
    return results, health


def test_thousand_requests_survive_injected_ooms(twin_server) -> None:  # noqa: ANN001
    server = twin_server("--inject-oom-rate", "0.01", "--policy", "adaptive")
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    results, health = asyncio.run(drive(server.url, model))
    assert len(results) == N_REQUESTS
    assert all(want == got for want, got in results)
    assert health and set(health) == {200}
    assert metric(server.url, "vllm:request_success_total", finished_reason="length") == N_REQUESTS
    assert metric(server.url, "headroom_ooms_recovered_total") > 0
    assert metric(server.url, "headroom_ooms_total") == metric(server.url, "headroom_ooms_recovered_total")
