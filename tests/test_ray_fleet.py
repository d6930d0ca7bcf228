"""The Ray Serve fleet end to end, on one local Ray cluster for the module: 2 twin replicas behind one port.

The openai client's chat, stream and usage answer exactly as from a single `headroom serve` on the same twin;
`/metrics` carries both replicas' series; a replica killed mid-load is restarted by Ray, and every request
completes: those on it resumed on the other (engine/serving/ray_serve/resend.py), counted in `/metrics`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'headroom[ray]'")
openai = pytest.importorskip("openai")

from engine.config import EngineConfig, ServerConfig  # noqa: E402
from engine.serving.ray_serve import launcher  # noqa: E402
from engine.serving.ray_serve.forwarding import REPLICA_HEADER  # noqa: E402
from engine.serving.ray_serve.metrics_board import metrics_board  # noqa: E402

pytestmark = pytest.mark.timeout(600)

REPLICAS = 2
RESTART_TIMEOUT_S = 120
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def fleet() -> Iterator[str]:
    url = launcher.start(EngineConfig(backend="twin", realtime=True), ServerConfig(port=0, replicas=REPLICAS))
    try:
        yield url
    finally:
        launcher.stop(local=True)


def live_replicas() -> dict[str, int]:
    import ray

    entries = ray.get(metrics_board().entries.remote())
    return {replica: entry["pid"] for replica, entry in entries.items()}


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def client(url: str):  # noqa: ANN201 - openai.OpenAI
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_answers(c) -> dict:  # noqa: ANN001
    model = c.models.list().data[0].id
    plain = c.chat.completions.create(model=model, messages=CHAT, max_tokens=7, temperature=0)
    chunks = list(c.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    return {
        "model": plain.model,
        "content": plain.choices[0].message.content,
        "finish": plain.choices[0].finish_reason,
        "usage": plain.usage.model_dump(exclude_none=True),
        "streamed": "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices),
        "stream_finish": [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1],
        "stream_usage": chunks[-1].usage.model_dump(exclude_none=True),
    }


def test_the_openai_client_gets_the_same_answers_as_from_one_server(fleet: str, twin_server) -> None:  # noqa: ANN001
    expected = chat_answers(client(twin_server().url))
    assert expected["usage"]["completion_tokens"] == 7 and expected["stream_usage"]["completion_tokens"] == 5
    for _ in range(3):  # a few requests, so both replicas answer
        assert chat_answers(client(fleet)) == expected


def test_chats_that_share_a_system_prompt_go_where_it_is_cached(fleet: str) -> None:
    """Both replicas idle: the first chat's replica is a coin toss, the next ones go to it (its cached system
    prompt is work the other would do). The gap lets the replicas publish stats that include the last chat."""
    system = {"role": "system", "content": "You answer questions about geography in one short sentence. " * 8}
    replicas = []
    for question in ("What is the capital of France?", "And of Spain?", "And of Italy?"):
        body = {"model": "default", "messages": [system, {"role": "user", "content": question}], "max_tokens": 4}
        r = httpx.post(fleet + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200
        replicas.append(r.headers[REPLICA_HEADER.decode()])
        time.sleep(2.0)
    assert len(set(replicas)) == 1, replicas


def test_bad_input_is_an_openai_error_through_the_fleet(fleet: str) -> None:
    r = httpx.post(fleet + "/v1/chat/completions", content=b"{bad", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(fleet + "/v1/chat/completions", json={"model": "nope", "messages": CHAT}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_metrics_serves_every_replica_with_a_replica_label(fleet: str) -> None:
    wait_for(lambda: len(live_replicas()) == REPLICAS, 30, "both replicas on the metrics board")
    text = httpx.get(fleet + "/metrics", timeout=30).text
    labelled = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("headroom_kv_blocks_free{")}  # fmt: skip
    assert labelled == set(live_replicas())


def running(url: str) -> float:
    """Requests running over the whole fleet, from its /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running{")
    )


def test_a_client_that_leaves_mid_stream_frees_its_replica(fleet: str) -> None:
    body = {"model": "default", "messages": CHAT, "max_tokens": 2000, "stream": True}
    with httpx.Client(base_url=fleet, timeout=60) as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: dropping the iterator would close the stream here
        next(line for line in lines if line.startswith("data: "))
        wait_for(lambda: running(fleet) == 1, 20, "the stream to run on a replica")
    wait_for(lambda: running(fleet) == 0, 20, "the left request to be aborted on its replica")


async def stream_one(http: httpx.AsyncClient, started: asyncio.Event, counter: list[int], total: int) -> dict:
    """One long streamed chat: which replica answered and how it ended (done, or the error event's code)."""
    body = {"model": "default", "messages": CHAT, "max_tokens": 400, "stream": True}
    outcome: dict = {"replica": None, "end": None}
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        outcome["status"] = r.status_code
        outcome["replica"] = r.headers.get(REPLICA_HEADER.decode())
        first = True
        async for line in r.aiter_lines():
            if first and line.startswith("data: "):
                first = False
                counter[0] += 1
                if counter[0] == total:
                    started.set()
            if line == "data: [DONE]" and outcome["end"] is None:
                outcome["end"] = "done"
            elif line.startswith("data: ") and '"error"' in line:
                outcome["end"] = json.loads(line[6:])["error"]["code"]
    return outcome


async def load_and_kill(url: str, pid: int, n: int) -> list[dict]:
    started, counter = asyncio.Event(), [0]
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        tasks = [asyncio.create_task(stream_one(http, started, counter, n)) for _ in range(n)]
        await asyncio.wait_for(started.wait(), 60)
        os.kill(pid, signal.SIGKILL)
        return list(await asyncio.gather(*tasks))


def test_a_killed_replica_is_restarted_and_its_streams_resume_on_the_other(fleet: str) -> None:
    wait_for(lambda: len(live_replicas()) == REPLICAS, 30, "both replicas on the metrics board")
    before = live_replicas()
    killed = sorted(before)[0]
    outcomes = asyncio.run(load_and_kill(fleet, before[killed], n=8))
    on_killed = [o for o in outcomes if o["replica"] == killed]
    others = [o for o in outcomes if o["replica"] != killed]
    print(f"killed replica {killed}: {len(on_killed)} requests on it, {len(others)} elsewhere")
    assert on_killed and others, outcomes  # the load reached both replicas
    assert all(o["status"] == 200 and o["end"] == "done" for o in outcomes), outcomes
    resumed = [line for line in httpx.get(fleet + "/metrics", timeout=30).text.splitlines()
               if line.startswith("headroom_fleet_resends_total") and f'replica="{killed}"' in line]  # fmt: skip
    assert resumed and sum(float(line.split()[-1]) for line in resumed) >= len(on_killed), resumed
    wait_for(lambda: len(set(live_replicas()) - set(before)) == 1 and killed not in live_replicas(),
             RESTART_TIMEOUT_S, "Ray to restart the killed replica")  # fmt: skip
    wait_for(lambda: httpx.get(fleet + "/health", timeout=30).status_code == 200, 30, "the fleet to be healthy")
    answers = [chat_answers(client(fleet))["finish"] for _ in range(4)]
    assert answers == ["length"] * 4
