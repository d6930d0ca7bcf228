"""The FastAPI app: the routers of each concern, the error handlers, and the engine loop's lifetime.

- `openai_routes`: /v1/models, /v1/completions, /v1/chat/completions
- `controller_routes`: /controller/state, /controller/config
- `health_routes`: /health, /version, /metrics
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from engine.serving import controller_routes, health_routes, openai_routes
from engine.serving.context import AppContext
from engine.serving.errors import install_error_handlers
from engine.serving.protocol import bound_token_ids


def create_app(ctx: AppContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, ctx.engine.stop)
            if ctx.trace is not None:
                ctx.trace.close()

    app = FastAPI(
        title="Headroom", version=health_routes.package_version(), lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.ctx = ctx
    install_error_handlers(app)
    schema_with_400 = app.openapi
    app.openapi = lambda: bound_token_ids(schema_with_400(), ctx.vocab_size)  # type: ignore[method-assign]
    for module in (openai_routes, controller_routes, health_routes):
        app.include_router(module.router)
    return app
