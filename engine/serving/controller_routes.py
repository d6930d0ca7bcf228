"""The controller's window: `GET /controller/state` and `PATCH /controller/config`.

Both go through the engine thread's command queue (AsyncEngine.controller_state / update_config): the policy
is the engine thread's, and a config change lands between two steps, never inside one.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field, create_model

from controller.config import ControllerConfig
from engine.core.llm_engine import EngineDeadError
from engine.serving.context import Ctx, engine_counters, require_admin
from engine.serving.errors import APIError, engine_error, error_responses
from engine.serving.protocol import integer

DEFAULT_STATE_STEPS = 10

router = APIRouter(prefix="/controller")


def _patch_model() -> type[BaseModel]:
    """The PATCH body: any subset of the gains, each within its bounds, nothing else. The schema says so, so
    a client (or a schema fuzzer) knows what is valid before it asks; what only a combination of gains can
    break (recover_below <= backoff_threshold, ...) depends on the current config and answers 409."""
    hints = typing.get_type_hints(ControllerConfig)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(ControllerConfig):
        meta, kind = f.metadata, hints[f.name]
        if kind is int:
            kind = integer(ge=meta["min"], le=meta["max"])
        elif kind is float:
            kind = Annotated[float, Field(ge=meta["min"], le=meta["max"])]
        fields[f.name] = (kind, Field(None, description=f"{meta['doc']} ({meta['unit']})"))
    return create_model("ControllerConfigPatch", __config__=ConfigDict(extra="forbid", strict=True), **fields)


ControllerConfigPatch = _patch_model()


@router.get("/state")
async def controller_state(ctx: Ctx, steps: int = DEFAULT_STATE_STEPS) -> dict[str, Any]:
    state = dict(await ctx.engine.controller_state())
    state["engine"] = engine_counters(ctx)
    state["plant"] = ctx.plant
    if ctx.trace is not None:
        state["recent_steps"] = [r.to_dict() for r in ctx.trace.records(last=max(0, steps))]
    return state


@router.patch("/config", dependencies=[Depends(require_admin)], responses=error_responses(400, 401, 403, 409, 503))
async def controller_config(ctx: Ctx, patch: ControllerConfigPatch) -> dict[str, Any]:  # type: ignore[valid-type]
    try:
        return await ctx.engine.update_config(patch.model_dump(exclude_unset=True))  # type: ignore[attr-defined]
    except ValueError as e:
        raise APIError(409, str(e), code="config_conflict") from e
    except EngineDeadError as e:
        raise engine_error(e) from e
