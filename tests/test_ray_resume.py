"""No request lost when a replica dies, on Ray Serve with two CPU replicas of a real model (a tiny random Llama,
tests/tiny_families.py): a greedy stream, a seeded stream (temperature 1.0) and a non-streamed chat run on one
replica, whose process is killed mid-way. All three complete on the other with exactly the tokens an undisturbed
run gives (engine/serving/ray_serve/resend.py), and `/metrics` counts the resumes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'headroom[ray]'")

from engine.config import EngineConfig, ServerConfig  # noqa: E402
from engine.serving.ray_serve import launcher  # noqa: E402
from engine.serving.ray_serve.forwarding import REPLICA_HEADER  # noqa: E402
from tests.test_ray_fleet import live_replicas, wait_for  # noqa: E402
from tests.tiny_families import FAMILIES, build  # noqa: E402

pytestmark = pytest.mark.timeout(600)

TOKENS = 1200  # long enough that the kill lands mid-way
# shared by the three: after a first chat has put it in one replica's prefix cache, the router sends them there
SYSTEM = {"role": "system", "content": "You answer questions about the geography of Europe, briefly. " * 10}
STREAMS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 1.0, "seed": 1234}}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config_class, model_class, extra = FAMILIES["llama"]
    with patch.dict(FAMILIES, {"llama": (config_class, model_class, extra | {"max_position_embeddings": 2048})}):
        family = build("llama", tmp_path_factory.mktemp("llama"))
    ecfg = EngineConfig(model=str(family.hf_dir), dtype="float32", device="cpu")
    url = launcher.start(ecfg, ServerConfig(port=0, replicas=2, served_model_name=("m",)))
    try:
        yield url
    finally:
        launcher.stop(local=True)


def body(stream: bool, sampling: dict[str, Any], max_tokens: int = TOKENS) -> dict[str, Any]:
    messages = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
    return {"model": "m", "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "return_token_ids": True, **sampling}  # fmt: skip


async def streamed(http: httpx.AsyncClient, sampling: dict[str, Any], seen: dict[str, Any]) -> list[int]:
    """A stream's token ids; `seen` gets its replica and a count of the chunks so far."""
    ids: list[int] = []
    async with http.stream("POST", "/v1/chat/completions", json=body(True, sampling)) as r:
        assert r.status_code == 200
        seen["replica"] = r.headers[REPLICA_HEADER.decode()]
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                ids += (chunk["choices"][0].get("token_ids") or []) if chunk["choices"] else []
                seen["chunks"] = seen.get("chunks", 0) + 1
    return ids


async def answered(http: httpx.AsyncClient, max_tokens: int = TOKENS) -> tuple[list[int], str]:
    r = await http.post("/v1/chat/completions", json=body(False, {"temperature": 0}, max_tokens))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], r.headers[REPLICA_HEADER.decode()]


async def run(url: str, kill: bool) -> dict[str, list[int]]:
    """A short chat puts the system prompt in one replica's cache; after a stats period the three requests go
    there at once. With `kill`, that replica's process is killed once both streams have begun."""
    seen: dict[str, dict[str, Any]] = {name: {} for name in STREAMS}
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        _, home = await answered(http, max_tokens=2)
        await asyncio.sleep(2.5)  # the replicas publish their stats: the router sees the cached prompt's home
        streams = {name: asyncio.create_task(streamed(http, STREAMS[name], seen[name])) for name in STREAMS}
        plain = asyncio.create_task(answered(http))
        while min(seen[name].get("chunks", 0) for name in STREAMS) < 5:
            await asyncio.sleep(0.01)
        assert {seen[name]["replica"] for name in STREAMS} == {home}, (home, seen)
        if kill:
            os.kill(live_replicas()[home], signal.SIGKILL)
        return {name: await task for name, task in streams.items()} | {"plain": (await plain)[0]}


def test_a_killed_replicas_requests_finish_on_the_other_with_the_undisturbed_tokens(fleet: str) -> None:
    wait_for(lambda: len(live_replicas()) == 2, 60, "both replicas on the metrics board")
    undisturbed = asyncio.run(run(fleet, kill=False))
    assert all(len(undisturbed[n]) == TOKENS for n in ("greedy", "seeded", "plain"))
    killed = asyncio.run(run(fleet, kill=True))
    for name in ("greedy", "seeded", "plain"):
        assert killed[name] == undisturbed[name], name
    metrics = httpx.get(fleet + "/metrics", timeout=30).text
    counted = {line.split("{")[1].split("}")[0]: float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("headroom_fleet_resends_total{")}  # fmt: skip
    assert sum(v for k, v in counted.items() if 'outcome="resumed"' in k) >= 2, counted
    assert sum(v for k, v in counted.items() if 'outcome="lost"' in k) == 0, counted
