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
    reason = engine.dead_reason() if engine.error or not engine.snapshot.healthy else "the engine loop is not running"
    return JSONResponse(error_body(reason, SERVER_ERROR, None, "engine_dead"), status_code=503)


@router.get("/version")
async def version_info(ctx: Ctx) -> dict[str, Any]:
    core = ctx.engine.engine
    return {
        "version": package_version(),
        "model": ctx.model_name,
        "backend": type(core.backend).__name__,
        "policy": getattr(core.policy, "name", None),
    }


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
    m.observe_controller(controller_metrics(await ctx.engine.policy_state(), counters["ooms_recovered"]))
    m.observe_phases(ctx.engine.engine.phases.totals())
    return Response(m.exposition(), media_type=METRICS_CONTENT_TYPE)


def controller_metrics(state: dict[str, Any], ooms_recovered: int) -> dict[str, Any]:
    """Flatten policy.state() into the keys Metrics.observe_controller exports (absent keys are skipped)."""
    out: dict[str, Any] = dict(state.get("counters") or {})
    out["ooms_recovered"] = ooms_recovered
    budget = state.get("budget") or {}
    if budget.get("effective") is not None:
        out["budget_bytes"] = budget["effective"]
    estimator = state.get("estimator") or {}
    if estimator.get("last_prediction_bytes") is not None:
        out["predicted_peak_bytes"] = estimator["last_prediction_bytes"]
    floor = (estimator.get("margin") or {}).get("floor_bytes")
    if floor is not None:
        out["margin_bytes"] = floor
    pool = state.get("kv_pool") or {}
    if pool.get("sized"):
        out["kv_pool_bytes"] = pool["pool_bytes"]
    if state.get("effective_prefill_tokens") is not None:  # what a fleet's headroom router routes by
        out["effective_prefill_tokens"] = state["effective_prefill_tokens"]
    if "emergency" in state:
        out["emergency"] = float(bool(state["emergency"]))
    return out
