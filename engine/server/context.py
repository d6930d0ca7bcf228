"""What every route reads: the engine thread's handle and the server's wiring, kept on `app.state`.

Routes are plain module-level functions that take the context through `Depends(context)`, so each concern
(OpenAI API, controller, health and metrics) lives in its own module without closures over `create_app`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from engine.server.async_engine import AsyncEngine
from engine.server.errors import APIError
from telemetry.metrics import Metrics
from telemetry.trace import StepTrace


@dataclass
class AppContext:
    engine: AsyncEngine
    model_name: str  # the first served name: responses carry it
    tokenizer: Any  # the backend's, or engine.server.standin.StandInTokenizer for the twin
    api_key: str | None = None
    metrics: Metrics | None = None
    trace: StepTrace | None = None
    vocab_size: int | None = None  # token ids in prompts must be below it (None: unchecked)
    other_names: tuple[str, ...] = ()  # further names a request may use for the model (/v1/models lists all)

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.other_names)


def context(request: Request) -> AppContext:
    return request.app.state.ctx


Ctx = Annotated[AppContext, Depends(context)]


def engine_counters(ctx: AppContext) -> dict[str, Any]:
    engine = ctx.engine
    core = engine.engine
    alloc = core.allocator
    return {
        "healthy": engine.healthy,
        "steps": core.step_id,
        "ooms": core.ooms,
        "ooms_recovered": core.ooms_recovered,
        "num_running": engine.num_running(),
        "num_waiting": engine.num_waiting(),
        "max_waiting": engine.max_waiting,
        "kv_blocks_used": alloc.num_used,
        "kv_blocks_free": alloc.num_free,
        "kv_blocks_total": alloc.num_blocks,
        "block_size": alloc.block_size,
        "max_model_len": core.max_model_len,
    }


def require_key(request: Request) -> None:
    key = context(request).api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    token = header[7:] if header[:7].lower() == "bearer " else ""
    if not secrets.compare_digest(token.encode(), key.encode()):
        raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)", code="invalid_api_key")
