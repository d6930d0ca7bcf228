"""No request lost when a replica dies: the ingress sends it again, through the same router, to another replica.

A request that had sent nothing to the client is simply sent again. A stream that had begun is resumed: the
next replica gets the request with `resume` (engine/serving/protocol.py: the tokens the client got and how much of
their text), prefills the prompt and those tokens (a prefix-cache hit where the prompt was seen), and goes on with
the same sampling, so greedy and seeded streams continue with exactly the tokens the dead replica would have sent.
The client sees one stream: the next replica's chunks carry the first one's id and creation time, and its
opening (the chat role) is not repeated.

`Attempts` is the one rule of how often (at most `bound` re-sends: a request that kills every replica it lands
on cannot take the fleet down); the fleet simulator (bench/fleet/sim.py) runs it as the ingress does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from starlette.responses import Response, StreamingResponse
from starlette.types import Message

from engine.serving.answer_bodies import RESUMABLE_HEADER
from engine.serving.ray_serve.forwarding import (
    EVENT_STREAM,
    REPLICA_HEADER,
    ForwardedRequest,
    replica_unavailable,
    unavailable_response,
)

logger = logging.getLogger("headroom.ray")

MAX_RESENDS = 2  # ServerConfig.max_resends' default
ANSWER_PATHS = ("/v1/completions", "/v1/chat/completions")
# A replica's 503 (or a stream's error event) saying it cannot finish the request: its engine stopped (a drain
# on SIGTERM past --shutdown-grace, an unrecovered OOM) or ended the request. It is handed back, as if it had died.
HANDED_BACK = frozenset({"engine_dead", "engine_error"})


class HandedBack(Exception):
    """A replica gave a request back (HANDED_BACK)."""


@dataclass
class Attempts:
    """One request's tries, and what its client has of the stream so far."""

    bound: int = MAX_RESENDS
    resends: int = 0
    token_ids: list[int] = field(default_factory=list)
    text_sent: int = 0  # characters of the generated text the client got

    def resend(self) -> bool:
        """Take one more try, if the bound allows it."""
        if self.resends >= self.bound:
            return False
        self.resends += 1
        return True

    @property
    def resumes(self) -> bool:
        """The next try goes on from what the client has (else it starts over)."""
        return bool(self.token_ids)


def tracked(request: ForwardedRequest) -> tuple[ForwardedRequest, bool]:
    """The request as the ingress forwards it, and whether its client asked for token ids itself: a stream of an
    answer endpoint asks for them (vLLM's `return_token_ids`), so the ingress knows which tokens the client has."""
    body = _loads(request.body)
    if request.path not in ANSWER_PATHS or body.get("stream") is not True:
        return request, False
    wanted = body.get("return_token_ids") is True
    return replace(request, body=json.dumps(body | {"return_token_ids": True}).encode()), wanted


def next_try(request: ForwardedRequest, attempts: Attempts) -> ForwardedRequest:
    """The request to send again: as it was, or resumed from what the client has."""
    if not attempts.resumes:
        return request
    body = _loads(request.body)
    resume = {"token_ids": attempts.token_ids, "text_sent": attempts.text_sent}
    return replace(request, body=json.dumps(body | {"resume": resume}).encode())


class StreamRelay:
    """The events of one answer's stream as the client gets them, across the replicas that serve it: records the
    tokens and text each chunk carries, gives every chunk the first replica's id and creation time, takes out the
    token ids the client did not ask for, and leaves out a new replica's opening when the client has one."""

    def __init__(self, attempts: Attempts, ids_wanted: bool) -> None:
        self.attempts = attempts
        self.ids_wanted = ids_wanted
        self._first: tuple[Any, Any] | None = None  # (id, created) of the first chunk
        self._opened = False  # the client has a chunk of this answer
        self._skipping = False  # a replica taking over from nothing: its chunks before the first token go
        self._pending = b""
        self.handed_back = False  # the replica's last event gave the request back (HANDED_BACK)

    def take_over(self) -> None:
        """Another replica's events follow."""
        self._skipping = self._opened and not self.attempts.resumes
        self._pending = b""
        self.handed_back = False

    def relay(self, data: bytes) -> bytes:
        """What to send the client of a replica's body bytes (whole events only; a partial one waits)."""
        self._pending += data
        *events, self._pending = self._pending.split(b"\n\n")
        out = b""
        for event in events:
            out += self._event(event)
            if self.handed_back:  # what follows is that replica's end; the next one's events take over
                break
        return out

    def _event(self, event: bytes) -> bytes:
        data = event.removeprefix(b"data: ")
        if not event.startswith(b"data: ") or data == b"[DONE]":
            return event + b"\n\n"
        chunk = json.loads(data)
        if "choices" not in chunk:  # an error event
            self.handed_back = _handed_back(chunk)
            return b"" if self.handed_back else event + b"\n\n"
        if self._first is None:
            self._first = chunk.get("id"), chunk.get("created")
        chunk["id"], chunk["created"] = self._first
        tokens = [t for choice in chunk["choices"] for t in choice.get("token_ids") or []]
        if self._skipping and not tokens:
            return b""
        self._skipping = False
        self._record(chunk, tokens)
        self._opened = True
        return b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"

    def _record(self, chunk: dict[str, Any], tokens: list[int]) -> None:
        self.attempts.token_ids += tokens
        for choice in chunk["choices"]:
            self.attempts.text_sent += len(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            if not self.ids_wanted:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
        if not self.ids_wanted:
            chunk.pop("prompt_token_ids", None)


class ResendCounter(Protocol):
    """Where the ingress counts what it did for a request whose replica died (its /metrics)."""

    def __call__(self, replica: str, outcome: str) -> None: ...  # outcome: resent, resumed or lost


Send = Callable[[ForwardedRequest], Any]  # a request -> the replica's ASGI messages (an async iterator)


async def relay(
    send: Send, request: ForwardedRequest, retryable: tuple[type[BaseException], ...], bound: int, count: ResendCounter
) -> Response:
    """The client's answer to `request`, sent again (at most `bound` times) wherever its replica dies: a 503 past
    the bound before the answer began, an error event past it in a stream."""
    request, ids_wanted = tracked(request)
    attempts = Attempts(bound)
    while True:
        messages, replica = send(request), "unknown"
        try:
            start = await messages.__anext__()
            replica = _replica(start)
            if _is_events(start):
                break
            body = b"".join([m.get("body", b"") async for m in messages])  # nothing sent yet: a death here re-sends
            if start["status"] == 503 and _handed_back(_loads(body)):
                raise HandedBack(start["status"])
            response = Response(body, start["status"])
            response.raw_headers = _headers(start)  # the replica's, content-length included
            return response
        except (*retryable, StopAsyncIteration, HandedBack) as e:
            if not attempts.resend():
                count(replica, "lost")
                return unavailable_response(type(e).__name__)
            count(replica, "resent")
    response = StreamingResponse(
        _Stream(send, request, retryable, StreamRelay(attempts, ids_wanted), count).events(messages, start),
        status_code=start["status"],
    )
    response.raw_headers = _headers(start)
    return response


@dataclass
class _Stream:
    """One stream's events, from its replica and, each time one dies, from the next."""

    send: Send
    request: ForwardedRequest
    retryable: tuple[type[BaseException], ...]
    relay: StreamRelay
    count: ResendCounter

    async def events(self, messages: Any, start: Message) -> AsyncIterator[bytes]:
        ended = False
        try:
            while True:
                try:
                    async for message in messages:
                        yield self.relay.relay(message.get("body", b""))
                        if self.relay.handed_back:
                            raise HandedBack(_replica(start))
                    ended = True
                    return
                except (*self.retryable, HandedBack) as e:
                    logger.warning("replica %s died mid-stream: %s", _replica(start), type(e).__name__)
                    if isinstance(e, HandedBack):  # alive: what it still has to say is no one's
                        messages.cancel()
                    messages, start, refusal = await self._take_over(start, type(e).__name__)
                if refusal is not None:
                    ended = True
                    yield refusal
                    return
        finally:
            if not ended:  # the client left: stop the replica's request too
                messages.cancel()

    async def _take_over(self, start: Message, error: str) -> tuple[Any, Message, bytes | None]:
        """The next replica's messages and start, or the error events that end the stream (None: go on)."""
        attempts, died = self.relay.attempts, _replica(start)
        resumable = dict(start["headers"]).get(RESUMABLE_HEADER.encode(), b"") == b"1"
        while True:
            if (attempts.resumes and not resumable) or not attempts.resend():
                self.count(died, "lost")
                return None, start, _events(replica_unavailable(error))
            self.count(died, "resumed" if attempts.resumes else "resent")
            self.relay.take_over()
            messages = self.send(next_try(self.request, attempts))
            try:
                start = await messages.__anext__()
            except (*self.retryable, StopAsyncIteration) as e:
                died, error = "unknown", type(e).__name__
                continue
            if start["status"] != 200:  # refused there (a full queue's 429): its error ends the stream
                body = _loads(b"".join([m.get("body", b"") async for m in messages]))
                if start["status"] == 503 and _handed_back(body):
                    died, error = _replica(start), "HandedBack"
                    continue
                return None, start, _events(body)
            return messages, start, None


def _loads(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _handed_back(doc: dict[str, Any]) -> bool:
    error = doc.get("error")
    return isinstance(error, dict) and error.get("code") in HANDED_BACK


def _events(error: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


def _is_events(start: Message) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(EVENT_STREAM) for k, v in start["headers"])


def _headers(start: Message) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in start["headers"] if k.lower() != RESUMABLE_HEADER.encode()]


def _replica(start: Message) -> str:
    return dict(start["headers"]).get(REPLICA_HEADER, b"unknown").decode()
