"""The FastAPI app: OpenAI completions and chat (streaming and not), health, metrics, controller state.

Handlers never touch the engine directly: they tokenize, validate what the engine does not (model name,
unsupported options, token ids), submit through `AsyncEngine.add` and turn the returned updates into text
with `TextStream`, so the streamed deltas and the non-streamed text come from the same code.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Body, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.llm_engine import EngineDeadError, RequestError
from engine.sampling_params import SamplingParams
from engine.server import protocol as p
from engine.server.async_engine import AsyncEngine, QueueFullError, RequestHandle, Update
from engine.server.errors import SERVER_ERROR, APIError, bad_request, error_body, install_error_handlers
from engine.server.text import TextStream
from telemetry.metrics import Metrics
from telemetry.trace import StepTrace

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DISCONNECT_POLL_S = 0.5  # non-streaming requests: how often to check whether the client is still there
DEFAULT_STATE_STEPS = 10


@dataclass
class ServerConfig:
    model_name: str  # the name /v1/models lists and requests must use
    tokenizer: Any  # the backend's, or engine.server.standin.StandInTokenizer for the twin
    api_key: str | None = None
    metrics: Metrics | None = None
    trace: StepTrace | None = None
    vocab_size: int | None = None  # token ids in prompts must be below it (None: unchecked)


def _package_version() -> str:
    try:
        return version("headroom")
    except PackageNotFoundError:
        return "unknown"


def _sse(obj: dict[str, Any] | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


def _engine_error(e: Exception) -> APIError:
    """Map what AsyncEngine.add raises to an HTTP answer."""
    if isinstance(e, RequestError):
        return bad_request(str(e), e.param, e.code)
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), "rate_limit_error", None, "queue_full", {"Retry-After": str(e.retry_after)})
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), SERVER_ERROR, None, "engine_dead")
    raise e


class _AbortOnClose(StreamingResponse):
    """An SSE response that aborts its request however the response ends (client gone, error, shutdown)."""

    def __init__(self, content: AsyncIterator[str], handle: RequestHandle) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._handle.abort()


def _text_of(update: Update, text: TextStream) -> tuple[str, str | None]:
    """(text delta, finish_reason) for one engine update; the last update carries the finish reason."""
    delta = text.add(update.token_ids)
    reason = update.finish_reason
    if reason is None:
        return delta, None
    if reason not in ("stop", "length"):  # "error": the engine failed it (unrecovered OOM); "abort"
        raise APIError(503, f"the request was ended by the engine ({reason})", SERVER_ERROR, None, "engine_error")
    return delta + text.finish(update.stop_text_len), reason


async def _updates(handle: RequestHandle, text: TextStream) -> AsyncIterator[tuple[str, str | None]]:
    """For streams: (delta, finish_reason) per update that has something to send."""
    try:
        async for update in handle:
            delta, reason = _text_of(update, text)
            if delta or reason is not None:
                yield delta, reason
    except EngineDeadError as e:  # the loop died or stopped while this request ran
        raise _engine_error(e) from e


async def _collect(handle: RequestHandle, text: TextStream, request: Request) -> str | None:
    """Run a non-streaming request to its end; the finish reason, or None when the client went away.

    The client is checked every DISCONNECT_POLL_S of wall time (updates may arrive faster than that, so
    the check is not tied to a timeout) and a gone client's request is aborted. The wait is on the
    handle's coroutine, not on a generator: a timeout cancels what it waits on, and a cancelled
    generator is finished, while a cancelled `RequestHandle.__anext__` consumes nothing."""
    loop = asyncio.get_running_loop()
    check_at = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            try:
                update = await asyncio.wait_for(anext(handle), max(0.001, check_at - loop.time()))
            except TimeoutError:
                update = None
            except EngineDeadError as e:
                raise _engine_error(e) from e
            if update is not None:
                _, reason = _text_of(update, text)
                if reason is not None:
                    return reason
            if loop.time() >= check_at:
                if await request.is_disconnected():
                    return None
                check_at = loop.time() + DISCONNECT_POLL_S
    finally:
        handle.abort()


def create_app(engine: AsyncEngine, cfg: ServerConfig) -> FastAPI:
    tokenizer, model_name = cfg.tokenizer, cfg.model_name
    core = engine.engine

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)
            if cfg.trace is not None:
                cfg.trace.close()

    app = FastAPI(title="Headroom", version=_package_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)

    def require_key(request: Request) -> None:
        if cfg.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header[:7].lower() == "bearer " else ""
        if not secrets.compare_digest(token.encode(), cfg.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)", code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise bad_request(
                f"the model {name!r} does not exist; this server serves {model_name!r}", "model", "model_not_found"
            )

    def check_ids(ids: list[int]) -> list[int]:
        limit = cfg.vocab_size
        bad = [t for t in ids if t < 0 or (limit is not None and t >= limit)]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of range [0, {limit or 'inf'})", "prompt", "invalid_token_id")
        return ids

    async def submit(ids: list[int], params: SamplingParams) -> RequestHandle:
        try:
            return await engine.add(ids, params)
        except (RequestError, QueueFullError, EngineDeadError) as e:
            raise _engine_error(e) from e

    async def respond(
        req: p.CompletionRequest | p.ChatCompletionRequest,
        request: Request,
        ids: list[int],
        params: SamplingParams,
        kinds: tuple[str, str],
        body: Callable[..., dict[str, Any]],
        chunks: Callable[[str, int, RequestHandle, TextStream], AsyncIterator[dict]],
    ) -> Response:
        """What both endpoints do once the prompt is tokenized: submit, then answer with one JSON body or
        an SSE stream of `chunks`, the usage chunk if asked for, and [DONE]. `kinds` is (id prefix, chunk
        object name)."""
        handle = await submit(ids, params)
        text, rid, created = TextStream(tokenizer, params.stop), p.new_id(kinds[0]), p.now()
        if not req.stream:
            reason = await _collect(handle, text, request)
            if reason is None:
                return Response(status_code=499)
            use = p.usage(len(ids), handle.num_tokens)
            return JSONResponse(body(rid, created, model_name, text.final or "", reason, use))

        async def events() -> AsyncIterator[str]:
            try:
                async for chunk in chunks(rid, created, handle, text):
                    yield _sse(chunk)
                if req.include_usage:
                    use = p.usage(len(ids), handle.num_tokens)
                    yield _sse(p.usage_chunk(rid, created, model_name, kinds[1], use))
            except APIError as e:
                yield _sse(error_body(e.message, e.type, e.param, e.code))
            yield _sse("[DONE]")

        return _AbortOnClose(events(), handle)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        card = p.ModelCard(id=model_name, max_model_len=core.max_model_len)
        return {"object": "list", "data": [card.model_dump()]}

    @v1.post("/completions", response_model=None)
    async def completions(req: p.CompletionRequest, request: Request) -> Response:
        check_model(req.model)
        req.check_unsupported()
        prompt = req.single_prompt()
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else check_ids(list(prompt))
        params = req.sampling_params(req.max_tokens)

        async def chunks(rid: str, created: int, handle: RequestHandle, text: TextStream) -> AsyncIterator[dict]:
            async for delta, reason in _updates(handle, text):
                yield p.completion_chunk(rid, created, model_name, delta, reason, req.include_usage)

        return await respond(req, request, ids, params, ("cmpl", "text_completion"), p.completion_body, chunks)

    @v1.post("/chat/completions", response_model=None)
    async def chat(req: p.ChatCompletionRequest, request: Request) -> Response:
        check_model(req.model)
        req.check_unsupported()
        if not req.messages:
            raise bad_request("messages must not be empty", "messages", "empty_messages")
        try:
            prompt = tokenizer.apply_chat_template([m.as_template_input() for m in req.messages])
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation is the client's 400
            raise bad_request(f"cannot render the chat template: {e}", "messages") from e
        ids = tokenizer.encode(prompt)
        params = req.sampling_params(req.resolved_max_tokens())

        async def chunks(rid: str, created: int, handle: RequestHandle, text: TextStream) -> AsyncIterator[dict]:
            with_usage = req.include_usage
            yield p.chat_chunk(rid, created, model_name, {"role": "assistant", "content": ""}, None, with_usage)
            async for delta, reason in _updates(handle, text):
                if delta:
                    yield p.chat_chunk(rid, created, model_name, {"content": delta}, None, with_usage)
                if reason is not None:
                    yield p.chat_chunk(rid, created, model_name, {}, reason, with_usage)

        return await respond(req, request, ids, params, ("chatcmpl", "chat.completion.chunk"), p.chat_body, chunks)

    app.include_router(v1)

    @app.get("/health", response_model=None)
    async def health() -> Response:
        if engine.healthy:
            return JSONResponse({"status": "ok"})
        reason = engine.dead_reason() if engine.error or not core.healthy else "the engine loop is not running"
        return JSONResponse(error_body(reason, SERVER_ERROR, None, "engine_dead"), status_code=503)

    @app.get("/version")
    async def version_info() -> dict[str, Any]:
        return {
            "version": _package_version(),
            "model": model_name,
            "backend": type(core.backend).__name__,
            "policy": getattr(core.policy, "name", None),
        }

    def engine_counters() -> dict[str, Any]:
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

    @app.get("/metrics")
    async def metrics() -> Response:
        m = cfg.metrics
        if m is None:
            raise APIError(404, "metrics are disabled", code="not_found")
        counters = engine_counters()
        # Refresh what may have changed without a step (an abort frees KV while the engine idles).
        m.set_healthy(engine.healthy)
        m.kv_used.set(counters["kv_blocks_used"])
        m.kv_free.set(counters["kv_blocks_free"])
        m.kv_total.set(counters["kv_blocks_total"])
        m.kv_usage.set(counters["kv_blocks_used"] / max(1, counters["kv_blocks_total"]))
        m.running.set(counters["num_running"])
        m.waiting.set(counters["num_waiting"])
        m.observe_controller(controller_metrics(core.policy.state(), core.ooms_recovered))
        return Response(m.exposition(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/controller/state")
    async def controller_state(steps: int = DEFAULT_STATE_STEPS) -> dict[str, Any]:
        state = dict(core.policy.state())
        state["engine"] = engine_counters()
        if cfg.trace is not None:
            state["recent_steps"] = [r.to_dict() for r in cfg.trace.records(last=max(0, steps))]
        return state

    @app.patch("/controller/config", dependencies=[Depends(require_key)])
    async def controller_config(patch: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
        try:
            core.policy.update_config(patch)
        except ValueError as e:
            raise bad_request(str(e), None, "invalid_config") from e
        return dict(core.policy.state())

    return app


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
    if "emergency" in state:
        out["emergency"] = float(bool(state["emergency"]))
    return out
