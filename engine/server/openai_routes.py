"""The OpenAI API: /v1/models, /v1/completions and /v1/chat/completions, streaming and not.

Handlers never touch the engine directly: they tokenize, validate what the engine does not (model name,
unsupported options, token ids), submit through `AsyncEngine.add` and turn the returned updates into text
with `TextStream`, so the streamed deltas and the non-streamed text come from the same code.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.llm_engine import EngineDeadError, RequestError
from engine.sampling_params import SamplingParams
from engine.server import protocol as p
from engine.server.async_engine import QueueFullError, RequestHandle, Update
from engine.server.context import AppContext, Ctx, require_key
from engine.server.errors import SERVER_ERROR, APIError, bad_request, error_body
from engine.server.text import TextStream

DISCONNECT_POLL_S = 0.5  # non-streaming requests: how often to check whether the client is still there

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])


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


def _check_model(ctx: AppContext, name: str | None) -> None:
    if name is not None and name != ctx.model_name:
        raise bad_request(
            f"the model {name!r} does not exist; this server serves {ctx.model_name!r}", "model", "model_not_found"
        )


def _check_ids(ctx: AppContext, ids: list[int]) -> list[int]:
    limit = ctx.vocab_size
    bad = [t for t in ids if t < 0 or (limit is not None and t >= limit)]
    if bad:
        raise bad_request(f"token id {bad[0]} is out of range [0, {limit or 'inf'})", "prompt", "invalid_token_id")
    return ids


async def _submit(ctx: AppContext, ids: list[int], params: SamplingParams) -> RequestHandle:
    try:
        return await ctx.engine.add(ids, params)
    except (RequestError, QueueFullError, EngineDeadError) as e:
        raise _engine_error(e) from e


async def _respond(
    ctx: AppContext,
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
    handle = await _submit(ctx, ids, params)
    text, rid, created, model_name = TextStream(ctx.tokenizer, params.stop), p.new_id(kinds[0]), p.now(), ctx.model_name
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


@router.get("/models")
async def models(ctx: Ctx) -> dict[str, Any]:
    card = p.ModelCard(id=ctx.model_name, max_model_len=ctx.engine.engine.max_model_len)
    return {"object": "list", "data": [card.model_dump()]}


@router.post("/completions", response_model=None)
async def completions(req: p.CompletionRequest, request: Request, ctx: Ctx) -> Response:
    _check_model(ctx, req.model)
    req.check_unsupported()
    prompt = req.single_prompt()
    ids = ctx.tokenizer.encode(prompt) if isinstance(prompt, str) else _check_ids(ctx, list(prompt))
    params = req.sampling_params(req.max_tokens)

    async def chunks(rid: str, created: int, handle: RequestHandle, text: TextStream) -> AsyncIterator[dict]:
        async for delta, reason in _updates(handle, text):
            yield p.completion_chunk(rid, created, ctx.model_name, delta, reason, req.include_usage)

    return await _respond(ctx, req, request, ids, params, ("cmpl", "text_completion"), p.completion_body, chunks)


@router.post("/chat/completions", response_model=None)
async def chat(req: p.ChatCompletionRequest, request: Request, ctx: Ctx) -> Response:
    _check_model(ctx, req.model)
    req.check_unsupported()
    if not req.messages:
        raise bad_request("messages must not be empty", "messages", "empty_messages")
    try:
        prompt = ctx.tokenizer.apply_chat_template([m.as_template_input() for m in req.messages])
    except Exception as e:  # noqa: BLE001 - a template that rejects the conversation is the client's 400
        raise bad_request(f"cannot render the chat template: {e}", "messages") from e
    ids = ctx.tokenizer.encode(prompt)
    params = req.sampling_params(req.resolved_max_tokens())

    async def chunks(rid: str, created: int, handle: RequestHandle, text: TextStream) -> AsyncIterator[dict]:
        name, with_usage = ctx.model_name, req.include_usage
        yield p.chat_chunk(rid, created, name, {"role": "assistant", "content": ""}, None, with_usage)
        async for delta, reason in _updates(handle, text):
            if delta:
                yield p.chat_chunk(rid, created, name, {"content": delta}, None, with_usage)
            if reason is not None:
                yield p.chat_chunk(rid, created, name, {}, reason, with_usage)

    return await _respond(ctx, req, request, ids, params, ("chatcmpl", "chat.completion.chunk"), p.chat_body, chunks)
