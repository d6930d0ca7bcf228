"""The controller's window: `GET /controller/state` and `PATCH /controller/config`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Depends

from engine.server.context import Ctx, engine_counters, require_key
from engine.server.errors import bad_request, error_responses

DEFAULT_STATE_STEPS = 10

router = APIRouter(prefix="/controller")


@router.get("/state")
async def controller_state(ctx: Ctx, steps: int = DEFAULT_STATE_STEPS) -> dict[str, Any]:
    state = dict(ctx.engine.engine.policy.state())
    state["engine"] = engine_counters(ctx)
    if ctx.trace is not None:
        state["recent_steps"] = [r.to_dict() for r in ctx.trace.records(last=max(0, steps))]
    return state


@router.patch("/config", dependencies=[Depends(require_key)], responses=error_responses(400, 401))
async def controller_config(ctx: Ctx, patch: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
    policy = ctx.engine.engine.policy
    try:
        policy.update_config(patch)
    except ValueError as e:
        raise bad_request(str(e), None, "invalid_config") from e
    return dict(policy.state())
