"""The event loop's side of engine requests and queries: each request's `RequestHandle`, and `deliver`, which
the engine thread schedules on the event loop (one call per step) to hand out what it produced."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from engine.frontend.output_processor import RequestOutput

ACCEPTED = object()  # first message to a request: the engine took it


class RequestHandle:
    """The asyncio side of one request: iterate for its RequestOutputs; `abort()` when the client goes away."""

    def __init__(self, request_id: str, prompt_len: int, on_abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.num_tokens = 0  # output tokens so far: the usage of the text handed out
        self.finished = False
        self._on_abort = on_abort
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    async def accepted(self) -> None:
        """Wait for the engine's answer to the add: ACCEPTED, or the request's error (raised here)."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.num_tokens += len(item.token_ids)
        if item.finish_reason is not None:
            self.finished = True
        return item

    def abort(self) -> None:
        """Idempotent; a no-op once the request finished."""
        if not self.finished:
            self.finished = True
            self._on_abort(self.request_id)


def deliver(batch: list[tuple[RequestHandle | asyncio.Future[Any], Any]]) -> None:
    """On the event loop: each item to its request, or a query's answer (or exception) to its future."""
    for target, item in batch:
        if isinstance(target, RequestHandle):
            target._queue.put_nowait(item)
        elif target.done():  # the asker went away (cancelled)
            continue
        elif isinstance(item, BaseException):
            target.set_exception(item)
        else:
            target.set_result(item)
