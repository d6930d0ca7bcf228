"""One replica of the fleet: one engine with its own controller, built from the configs' JSON, serving the same
FastAPI app as `headroom serve` (through `forwarding.call_app`).

It publishes what the headroom router needs (`record_routing_stats`, which Ray Serve polls) and pushes its
`/metrics` text to the metrics board every `METRICS_PUSH_S`, for the ingress to merge.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from engine.config import EngineConfig, ServerConfig
from engine.core.llm_engine import EngineDeadError
from engine.serving.launch import build_app
from engine.serving.ray_serve.forwarding import REPLICA_HEADER, ForwardedRequest, call_app
from engine.serving.ray_serve.headroom_policy import routing_stats
from engine.serving.ray_serve.metrics_board import metrics_board
from engine.serving.ray_serve.prompt_size import PromptSize

logger = logging.getLogger("headroom.ray")

METRICS_PUSH_S = 1.0
_METRICS = ForwardedRequest("GET", "/metrics", b"", (), b"", PromptSize(0))


class EngineReplica:
    async def __init__(self, engine_json: str, server_json: str) -> None:
        self.app = build_app(EngineConfig.from_json(engine_json), ServerConfig.from_json(server_json))
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the engine loop on this replica's event loop
        self.engine = self.app.state.ctx.engine
        self.replica = serve.get_replica_context().replica_tag
        self._board = metrics_board()
        self._pusher = asyncio.create_task(self._push_metrics())

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[dict[str, Any]]:
        """The app's ASGI messages for one forwarded request (call with `handle.options(stream=True)`); the
        answer names its replica in `x-headroom-replica`."""
        async for message in call_app(self.app, request):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], (REPLICA_HEADER, self.replica.encode())]}
            yield message

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the headroom router reads (headroom_policy.Headroom.of), with when it was taken."""
        load = None
        with contextlib.suppress(EngineDeadError):
            load = await self.engine.prefill_load()
        return routing_stats(
            self.engine.snapshot.stats, self.engine.num_waiting(), self.engine.healthy, load, time.time()
        )

    async def _metrics_text(self) -> str:
        return b"".join([m.get("body", b"") async for m in call_app(self.app, _METRICS)]).decode()

    async def _push_metrics(self) -> None:
        """For the replica's life: its /metrics text and pid onto the board."""
        while True:
            try:
                await self._board.put.remote(self.replica, await self._metrics_text(), os.getpid())
            except Exception:  # noqa: BLE001 - a missed push only ages this replica's series
                logger.exception("cannot publish metrics")
            await asyncio.sleep(METRICS_PUSH_S)
