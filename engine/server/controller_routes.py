"""The controller's window: `GET /controller/state` and `PATCH /controller/config`.

Both go through the engine thread's command queue (AsyncEngine.policy_state / update_config): the policy
is the engine thread's, and a config change lands between two steps, never inside one.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Depends

from engine.llm_engine import EngineDeadError
from engine.server.context import Ctx, engine_counters, require_admin
from engine.server.errors import SERVER_ERROR, APIError, bad_request, error_responses

DEFAULT_STATE_STEPS = 10

router = APIRouter(prefix="/controller")


@router.get("/state")
async def controller_state(ctx: Ctx, steps: int = DEFAULT_STATE_STEPS) -> dict[str, Any]:
    state = dict(await ctx.engine.policy_state())
    state["engine"] = engine_counters(ctx)
    if ctx.trace is not None:
        state["recent_steps"] = [r.to_dict() for r in ctx.trace.records(last=max(0, steps))]
    return state


@router.patch("/config", dependencies=[Depends(require_admin)], responses=error_responses(400, 401, 403, 503))
async def controller_config(ctx: Ctx, patch: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
    try:
        return await ctx.engine.update_config(patch)
    except ValueError as e:
        raise bad_request(str(e), None, "invalid_config") from e
    except EngineDeadError as e:
        raise APIError(503, str(e), SERVER_ERROR, None, "engine_dead") from e
