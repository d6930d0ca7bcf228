"""The fleet's HTTP ingress: every request is sized (`prompt_size`) and forwarded whole to an engine replica
through a deployment handle, whose router picks the replica; one whose replica dies is sent to another
(`resend`). `GET /metrics` answers with every replica's series (`fleet_metrics`) and the ingress's re-sends. It
holds no engine and no API code of its own."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from ray.exceptions import ActorUnavailableError, RayActorError
from starlette.requests import Request
from starlette.responses import Response

from engine.serving.health_routes import METRICS_CONTENT_TYPE
from engine.serving.ray_serve.fleet_metrics import merge_expositions
from engine.serving.ray_serve.forwarding import ForwardedRequest
from engine.serving.ray_serve.metrics_board import metrics_board
from engine.serving.ray_serve.prompt_size import size_prompt
from engine.serving.ray_serve.resend import relay

RETRYABLE = (RayActorError, ActorUnavailableError)  # the replica died or cannot be reached


class Ingress:
    def __init__(self, engine: Any, max_resends: int) -> None:
        self._engine = engine.options(stream=True)
        self._board = metrics_board()
        self._max_resends = max_resends
        self._registry = CollectorRegistry(auto_describe=False)
        self._resends = Counter(
            "headroom_fleet_resends", "requests whose replica died, by that replica and what the ingress did: "
            "resent (nothing had reached the client), resumed (a begun stream), lost (past --max-resends)",
            ["replica", "outcome"], registry=self._registry,
        )  # fmt: skip

    async def __call__(self, request: Request) -> Response:
        if request.method == "GET" and request.url.path == "/metrics":
            return await self.fleet_metrics()
        body = await request.body()
        scope = request.scope
        forwarded = ForwardedRequest(
            request.method, scope["path"], scope["query_string"], tuple(map(tuple, scope["headers"])), body,
            size_prompt(body),
        )  # fmt: skip
        return await relay(self._engine.handle.remote, forwarded, RETRYABLE, self._max_resends, self._count)

    def _count(self, replica: str, outcome: str) -> None:
        self._resends.labels(replica, outcome).inc()

    async def fleet_metrics(self) -> Response:
        entries = await self._board.entries.remote()
        text = merge_expositions({replica: entry["text"] for replica, entry in entries.items()})
        return Response(text + generate_latest(self._registry), media_type=METRICS_CONTENT_TYPE)
