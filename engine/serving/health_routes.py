"""Liveness and observability: `/health`, `/version` and the Prometheus `/metrics`."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from engine.serving.context import Ctx, engine_counters
from engine.serving.errors import SERVER_ERROR, APIError, error_body, error_responses

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

router = APIRouter()


def package_version() -> str:
    try:
        return version("headroom")
    except PackageNotFoundError:
        return "unknown"


@router.get("/health", response_model=None, responses=error_responses(503))
async def health(ctx: Ctx) -> Response:
    engine = ctx.engine
    if engine.draining:  # out of a load balancer's rotation while the open requests finish
        return JSONResponse(error_body(engine.dead_reason(), SERVER_ERROR, None, "shutting_down"), status_code=503)
    if engine.healthy:
        return JSONResponse({"status": "ok"})
    reason = (
        engine.dead_reason() if engine.error or not engine.snapshot.stats.healthy else "the engine loop is not running"
    )
    return JSONResponse(error_body(reason, SERVER_ERROR, None, "engine_dead"), status_code=503)


@router.get("/version")
async def version_info(ctx: Ctx) -> dict[str, Any]:
    info = ctx.engine.info
    return {"version": package_version(), "model": ctx.model_name, "backend": info.backend, "policy": info.policy}


@router.get("/metrics", response_class=PlainTextResponse, responses=error_responses(404))
async def metrics(ctx: Ctx) -> Response:
    m = ctx.metrics
    if m is None:
        raise APIError(404, "metrics are disabled", code="not_found")
    counters = engine_counters(ctx)
    # Refresh what may have changed without a step (an abort frees KV while the engine idles).
    m.set_healthy(ctx.engine.healthy)
    m.kv_used.set(counters["kv_blocks_used"])
    m.kv_free.set(counters["kv_blocks_free"])
    m.kv_total.set(counters["kv_blocks_total"])
    m.kv_usage.set(counters["kv_blocks_used"] / max(1, counters["kv_blocks_total"]))
    m.running.set(counters["num_running"])
    m.waiting.set(counters["num_waiting"])
    m.observe_controller(await ctx.engine.controller_stats())
    m.observe_phases(counters["step_phases_s"])
    return Response(m.exposition(), media_type=METRICS_CONTENT_TYPE)
