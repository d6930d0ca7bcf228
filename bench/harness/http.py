"""One OpenAI-API client for the benchmarks (httpx, asyncio): a completion or chat request, streamed or
not, with its token times. TTFT, ITL and E2E follow `vllm bench serve`: from the request sent to the first
content chunk, between content chunks, to the end of the answer."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


def status(url: str, timeout: float = 2.0) -> int:
    """The status of a GET; 0 when nothing answers (yet)."""
    try:
        return httpx.get(url, timeout=timeout).status_code
    except httpx.HTTPError:
        return 0


def get_json(url: str, timeout: float = 30.0) -> Any:
    r = httpx.get(url, timeout=timeout)
    r.raise_for_status()
    return r.json()


def post(url: str, body: dict[str, Any], timeout: float | None = 600.0) -> httpx.Response:
    """One blocking POST of a JSON body (for threads; the async `request` times tokens)."""
    return httpx.post(url, json=body, timeout=timeout)


def client(url: str, connections: int = 100, timeout: float | None = 600.0) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits)


@dataclass
class Answer:
    """One request's answer. A non-200 answer keeps its `response` (read) and no content."""

    status: int = 0
    sent: float = 0.0  # time.perf_counter() when the request went out
    ended: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one per content chunk
    text: str = ""
    finishes: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    errors: list[Any] = field(default_factory=list)  # error events inside a 200 stream
    done: int = 0  # [DONE] events
    after_done: int = 0  # events after the first [DONE]
    disconnected: bool = False  # the client hung up on purpose
    response: httpx.Response | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.ended - self.sent

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def output_tokens(self) -> int:
        return self.usage["completion_tokens"] if self.usage else len(self.token_times)

    def add_event(self, payload: str, chat: bool) -> None:
        """One `data: ` payload of a stream."""
        if self.done:
            self.after_done += 1
        if payload == "[DONE]":
            self.done += 1
            return
        obj = json.loads(payload)
        if "error" in obj:
            self.errors.append(obj["error"])
            return
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices", []):
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if piece:
                self.text += piece
                self.token_times.append(time.perf_counter())
            if choice.get("finish_reason") is not None:
                self.finishes.append(choice["finish_reason"])


def is_chat(path: str) -> bool:
    return path.endswith("/chat/completions")


async def request(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], disconnect_after: int | None = None
) -> Answer:
    """POST `body` to `path`; streamed when body["stream"]. `disconnect_after`: hang up after this many
    content chunks. Transport errors raise (httpx.HTTPError)."""
    if body.get("stream"):
        return await _stream(http, path, body, disconnect_after)
    a = Answer(sent=time.perf_counter())
    r = await http.post(path, json=body)
    a.ended, a.status, a.response = time.perf_counter(), r.status_code, r
    if r.status_code == 200:
        data = r.json()
        for choice in data["choices"]:
            a.text += choice["message"]["content"] if is_chat(path) else choice["text"]
            a.finishes.append(choice["finish_reason"])
        a.usage = data.get("usage")
        a.token_times.append(a.ended)
    return a


async def _stream(http: httpx.AsyncClient, path: str, body: dict[str, Any], disconnect_after: int | None) -> Answer:
    a, chat = Answer(sent=time.perf_counter()), is_chat(path)
    async with http.stream("POST", path, json=body) as r:
        a.status, a.response = r.status_code, r
        if r.status_code != 200:
            await r.aread()
        else:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    a.add_event(line[len("data: ") :], chat)
                if disconnect_after is not None and len(a.token_times) >= disconnect_after:
                    a.disconnected = True
                    break  # leaving the block closes the connection
    a.ended = time.perf_counter()
    return a
