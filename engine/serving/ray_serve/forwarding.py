"""An HTTP request carried from the ingress to a replica, and the replica's ASGI answer carried back.

Why not Ray Serve's own ingress on the engine deployment: its proxy routes a request before reading the body,
so a router there cannot see the prompt. The ingress reads the body, sizes the prompt, and sends the request
through a deployment handle (where the headroom router runs); the replica runs the one FastAPI app of
`headroom serve` on it and streams the ASGI messages back, so streaming, errors and disconnects behave as
against one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message

from engine.serving.errors import SERVER_ERROR, error_body
from engine.serving.ray_serve.prompt_size import PromptSize

logger = logging.getLogger("headroom.ray")

APP_EXIT_WAIT_S = 5.0  # after the caller left: how long the app may take to abort its requests
RETRY_AFTER_S = 1  # a replica that died is restarted by Ray; another replica can take the request now
EVENT_STREAM = b"text/event-stream"
REPLICA_HEADER = b"x-headroom-replica"  # each answer names the replica that made it


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    prompt: PromptSize  # the router reads this (prompt_size.size_prompt of the body)


async def call_app(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[Message]:
    """Run `app` on `request`, yielding its `http.response.*` messages. When the caller stops iterating (its
    client left, or it died), the app sees `http.disconnect` and its sends fail, so it aborts the request."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if gone.is_set():
            raise OSError("the caller went away")
        await sent.put(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
        "query_string": request.query_string, "root_path": "", "headers": list(request.headers),
        "client": None, "server": None, "state": {},
    }  # fmt: skip

    async def run() -> None:
        try:
            await app(scope, receive, send)
        except Exception:  # noqa: BLE001 - the app already answered 500 where it could; the replica lives on
            logger.exception("the app failed on %s %s", request.method, request.path)
        finally:
            sent.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            yield message
    finally:
        gone.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(task, APP_EXIT_WAIT_S)


def replica_unavailable(what: str) -> dict[str, Any]:
    """The OpenAI-shaped body of a request whose replica died: retryable (Ray restarts the replica)."""
    return error_body(f"the replica serving this request is unavailable ({what}); retry", SERVER_ERROR, None,
                      "replica_unavailable")  # fmt: skip


def unavailable_response(what: str) -> Response:
    return JSONResponse(replica_unavailable(what), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
