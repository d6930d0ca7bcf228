"""The fleet's HTTP ingress: every request is sized (`prompt_size`) and forwarded whole to an engine replica
through a deployment handle, whose router picks the replica; `GET /metrics` answers with every replica's
series (`fleet_metrics`). It holds no engine and no API code of its own."""

from __future__ import annotations

from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from starlette.requests import Request
from starlette.responses import Response

from engine.serving.health_routes import METRICS_CONTENT_TYPE
from engine.serving.ray_serve.fleet_metrics import merge_expositions
from engine.serving.ray_serve.forwarding import ForwardedRequest, relay
from engine.serving.ray_serve.metrics_board import metrics_board
from engine.serving.ray_serve.prompt_size import size_prompt

RETRYABLE = (RayActorError, ActorUnavailableError)  # the replica died or cannot be reached


class Ingress:
    def __init__(self, engine: Any) -> None:
        self._engine = engine.options(stream=True)
        self._board = metrics_board()

    async def __call__(self, request: Request) -> Response:
        if request.method == "GET" and request.url.path == "/metrics":
            return await self.fleet_metrics()
        body = await request.body()
        scope = request.scope
        forwarded = ForwardedRequest(
            request.method, scope["path"], scope["query_string"], tuple(map(tuple, scope["headers"])), body,
            size_prompt(body),
        )  # fmt: skip
        return await relay(self._engine.handle.remote(forwarded), RETRYABLE)

    async def fleet_metrics(self) -> Response:
        entries = await self._board.entries.remote()
        text = merge_expositions({replica: entry["text"] for replica, entry in entries.items()})
        return Response(text, media_type=METRICS_CONTENT_TYPE)
