"""The fleet ingress's re-sends (engine/serving/ray_serve/resend.py), against replicas that die on cue: each is a
real server (the app `headroom serve` builds, on a tiny Llama) whose answer is cut after some events, as a Ray
replica's messages end when its process is killed, or ends with the 503 a drained engine gives.

- a stream cut mid-way goes on at the next replica: the client gets the undisturbed stream's tokens and text,
  one id throughout, the chat opening once, its own choice of token ids, and usage over every token;
- a request cut before it answered is sent again, a stream cut before its first token starts over;
- a request that fails on every replica is a 503 after the bound (an error event once its stream began), and the
  next request is served;
- every re-send is counted with the replica that died.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.responses import StreamingResponse
from starlette.types import Message

from engine.serving.ray_serve.forwarding import REPLICA_HEADER, ForwardedRequest
from engine.serving.ray_serve.prompt_size import size_prompt
from engine.serving.ray_serve.resend import relay
from tests.conftest import start_server
from tests.test_model_families import served
from tests.tiny_families import build

TOKENS = 16
HANDBACK = {"error": {"message": "the request was ended by the engine (abort)", "code": "engine_error"}}


class Died(Exception):
    """The replica's process ended (Ray's RayActorError, here)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("llama")).hf_dir


@pytest.fixture(scope="module")
def url(model: Path) -> Iterator[str]:
    with served(model, "--served-model-name", "m") as url:
        yield url


@dataclass
class Fleet:
    """Replicas r0, r1, ... in turn for each request sent, each a server (`urls[i]`, else `url`); replica i dies
    after `lives[i]` events (None: lives), or gives the request back (`handback`) at that point instead."""

    url: str
    lives: list[int | None]
    handback: bool = False
    urls: list[str] = field(default_factory=list)
    sent: list[dict[str, Any]] = field(default_factory=list)
    counted: list[tuple[str, str]] = field(default_factory=list)

    def send(self, request: ForwardedRequest) -> _Replica:
        i = len(self.sent)
        self.sent.append(json.loads(request.body))
        lives = self.lives[i] if i < len(self.lives) else None
        return _Replica(self.urls[i] if i < len(self.urls) else self.url, request, f"r{i}", lives, self.handback)

    def count(self, replica: str, outcome: str) -> None:
        self.counted.append((replica, outcome))

    def answer(self, path: str, body: dict[str, Any], bound: int = 2) -> tuple[int, bytes]:
        async def go() -> tuple[int, bytes]:
            raw = json.dumps(body).encode()
            request = ForwardedRequest("POST", path, b"", ((b"content-type", b"application/json"),), raw,
                                       size_prompt(raw))  # fmt: skip
            response = await relay(self.send, request, (Died,), bound, self.count)
            if isinstance(response, StreamingResponse):
                return response.status_code, b"".join([chunk async for chunk in response.body_iterator])
            return response.status_code, response.body

        return asyncio.run(go())


class _Replica:
    """A replica's ASGI messages for one request, from the server: the start, then one message an event."""

    def __init__(self, url: str, request: ForwardedRequest, name: str, lives: int | None, handback: bool) -> None:
        self._messages = self._answer(url, request, name, lives, handback)
        self.cancelled = False
        self.on_event: Callable[[int], object] = lambda n: None  # told each event's number as it passes

    def __aiter__(self) -> _Replica:
        return self

    async def __anext__(self) -> Message:
        return await self._messages.__anext__()

    def cancel(self) -> None:
        self.cancelled = True

    async def _answer(self, url: str, request: ForwardedRequest, name: str, lives: int | None,
                      handback: bool) -> AsyncIterator[Message]:  # fmt: skip
        async with (
            httpx.AsyncClient(timeout=60) as client,
            client.stream(
                "POST", url + request.path, content=request.body, headers={"content-type": "application/json"}
            ) as r,
        ):
            headers = [(k.encode(), v.encode()) for k, v in r.headers.items()]
            if lives == 0 and not handback:
                raise Died
            if lives == 0:
                body = json.dumps(HANDBACK).encode()
                yield {"type": "http.response.start", "status": 503, "headers": [(REPLICA_HEADER, name.encode())]}
                yield {"type": "http.response.body", "body": body}
                return
            yield {"type": "http.response.start", "status": r.status_code, "headers": [*headers, (REPLICA_HEADER,
                   name.encode())]}  # fmt: skip
            buffer, events = b"", 0
            async for data in r.aiter_raw():
                buffer += data
                *whole, buffer = buffer.split(b"\n\n")
                for event in whole:
                    if lives is not None and events == lives:
                        if not handback:
                            raise Died
                        yield {
                            "type": "http.response.body",
                            "body": b"data: " + json.dumps(HANDBACK).encode() + b"\n\n",
                        }
                        return
                    events += 1
                    self.on_event(events)
                    yield {"type": "http.response.body", "body": event + b"\n\n"}
            if buffer:
                yield {"type": "http.response.body", "body": buffer}


def chunks(raw: bytes) -> list[dict[str, Any]]:
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", raw[-300:]
    return [json.loads(e) for e in events[:-1]]


def text(cs: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0].get("text") or c["choices"][0]["delta"].get("content") or ""
                   for c in cs if c["choices"])  # fmt: skip


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Tell me about Paris."}], "max_tokens": TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra}  # fmt: skip


@pytest.mark.parametrize("handback", [False, True], ids=["killed", "handed-back"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"])
def test_a_stream_whose_replica_dies_goes_on_at_the_next_as_one_stream(
    url: str, sampling: dict[str, Any], handback: bool
) -> None:
    body = chat(**sampling)
    whole = chunks(Fleet(url, []).answer("/v1/chat/completions", body)[1])
    for lives in ([4], [4, 3], [9, 2]):  # one death; two, the second during the resumed stream
        fleet = Fleet(url, lives, handback)
        status, raw = fleet.answer("/v1/chat/completions", body)
        got = chunks(raw)
        assert status == 200
        assert text(got) == text(whole) and got[-1]["usage"] == whole[-1]["usage"]
        assert {c["id"] for c in got} == {whole[0]["id"].split("-")[0] + "-" + got[0]["id"].split("-")[1]}
        assert sum("role" in c["choices"][0]["delta"] for c in got if c["choices"]) == 1
        assert all("token_ids" not in c["choices"][0] for c in got if c["choices"])  # the client asked for none
        assert [s.get("resume") is not None for s in fleet.sent] == [False] + [True] * len(lives)
        assert fleet.counted == [(f"r{i}", "resumed") for i in range(len(lives))]


def test_the_client_gets_the_token_ids_it_asked_for(url: str) -> None:
    body = chat(temperature=0, return_token_ids=True)
    whole = chunks(Fleet(url, []).answer("/v1/chat/completions", body)[1])
    got = chunks(Fleet(url, [5]).answer("/v1/chat/completions", body)[1])
    ids = [t for c in whole if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    assert len(ids) == TOKENS
    assert [t for c in got if c["choices"] for t in c["choices"][0].get("token_ids") or []] == ids


def test_what_had_not_answered_is_sent_again(url: str) -> None:
    body = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0}
    want = json.loads(Fleet(url, []).answer("/v1/completions", body)[1])
    fleet = Fleet(url, [0])
    status, raw = fleet.answer("/v1/completions", body)
    assert status == 200 and json.loads(raw)["choices"] == want["choices"]
    assert fleet.counted == [("unknown", "resent")]
    stream = Fleet(url, [1])  # the chat opening only: the next replica starts over, its opening left out
    got = chunks(stream.answer("/v1/chat/completions", chat(temperature=0))[1])
    whole = chunks(Fleet(url, []).answer("/v1/chat/completions", chat(temperature=0))[1])
    assert text(got) == text(whole) and sum("role" in c["choices"][0]["delta"] for c in got if c["choices"]) == 1
    assert [s.get("resume") for s in stream.sent] == [None, None] and stream.counted == [("r0", "resent")]


@pytest.mark.parametrize("handback", [False, True], ids=["killed", "handed-back"])
def test_a_request_that_fails_everywhere_is_a_503_after_the_bound_and_the_next_is_served(
    url: str, handback: bool
) -> None:
    body = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 4}
    fleet = Fleet(url, [0, 0, 0], handback)
    status, raw = fleet.answer("/v1/completions", body, bound=2)
    assert status == 503 and json.loads(raw)["error"]["code"] == "replica_unavailable"
    assert len(fleet.sent) == 3 and [o for _, o in fleet.counted] == ["resent", "resent", "lost"]
    streamed = Fleet(url, [3, 2, 2], handback)
    got = chunks(streamed.answer("/v1/chat/completions", chat(temperature=0), bound=2)[1])
    assert got[-1]["error"]["code"] == "replica_unavailable" and len(streamed.sent) == 3
    assert Fleet(url, [None]).answer("/v1/completions", body)[0] == 200


def test_a_stream_that_cannot_resume_ends_with_an_error_event(url: str) -> None:
    """Two choices: no replica can go on from where the client is, once it has tokens."""
    fleet = Fleet(url, [6])
    got = chunks(fleet.answer("/v1/chat/completions", chat(temperature=0, n=2))[1])
    assert got[-1]["error"]["code"] == "replica_unavailable" and len(fleet.sent) == 1
    assert fleet.counted == [("r0", "lost")]


def test_a_draining_server_hands_its_streams_back(url: str, model: Path, tmp_path: Path) -> None:
    """A real drain: SIGTERM to a server with no grace, mid-stream. It ends the stream with the
    engine's 503 event, and the stream goes on at the next replica as after a death."""
    body = chat(temperature=1.0, seed=3, max_tokens=200)
    whole = chunks(Fleet(url, []).answer("/v1/chat/completions", body)[1])
    flags = ("--model", str(model), "--dtype", "float32", "--device", "cpu", "--served-model-name", "m",
             "--shutdown-grace", "0")  # fmt: skip
    draining = start_server(flags, tmp_path / "server.log")
    try:
        fleet = Fleet(url, [], urls=[draining.url])
        first = fleet.send

        def send(request: ForwardedRequest) -> _Replica:
            replica = first(request)
            if len(fleet.sent) == 1:
                replica.on_event = lambda n: n == 3 and draining.proc.send_signal(signal.SIGTERM)
            return replica

        fleet.send = send  # type: ignore[method-assign]
        got = chunks(fleet.answer("/v1/chat/completions", body)[1])
        assert draining.proc.wait(60) == 0
    finally:
        draining.stop()
    assert text(got) == text(whole) and got[-1]["usage"] == whole[-1]["usage"]
    assert fleet.counted == [("r0", "resumed")]
