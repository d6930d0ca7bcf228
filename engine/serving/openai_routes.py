"""The OpenAI API: /v1/models, /v1/completions and /v1/chat/completions, streaming and not.

Handlers never touch the engine directly: they check what the engine does not (model name, unsupported
fields, token ids), tokenize, submit one engine request per choice (`choices.submit`: each prompt times
`n`) and turn the merged messages (text deltas and logprob entries, decoded on the engine thread) into
answers, so streamed deltas and non-streamed bodies come from the same text. `_Endpoint` holds what differs
between the two endpoints. An answer names the model as the client asked for it (any served name), as
vLLM's does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.serving import protocol as p
from engine.serving.choices import Choice, ChoiceUpdates, submit
from engine.serving.context import AppContext, Ctx, require_key
from engine.serving.errors import APIError, bad_request, clip, error_body, error_responses, shorten
from engine.serving.logprobs import ChatLogprobs, CompletionLogprobs

DISCONNECT_POLL_S = 0.5  # non-streaming requests: how often to check whether the client is still there

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)], responses=error_responses(401))

# One server-sent event as a client parses it: `data` is a JSON chunk (or [DONE]).
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
ANSWER_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The answer: one JSON body, or with `stream` an SSE stream of chunks ending in [DONE]",
        "content": {"application/json": {}, "text/event-stream": {"schema": SSE_EVENT}},
    },
    **error_responses(400, 404, 429, 503),
}


def _sse(obj: dict[str, Any] | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


class _AbortOnClose(StreamingResponse):
    """An SSE response that ends its requests however the response ends (client gone, error, shutdown)."""

    def __init__(self, content: AsyncIterator[str], close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._close()


@dataclass(frozen=True)
class _Endpoint:
    """What differs between the completions and chat answers."""

    id_prefix: str
    body_object: str
    chunk_object: str
    logprobs: type[CompletionLogprobs] | type[ChatLogprobs]
    choice: Callable[[int, str, dict | None, str | None], dict[str, Any]]  # a body's choice
    opening: Callable[[int], list[dict[str, Any]]]  # a stream's first chunk choices for one choice
    deltas: Callable[[int, str, dict | None, str | None], list[dict[str, Any]]]  # a stream's, per update


def _completion_deltas(index: int, text: str, logprobs: dict | None, reason: str | None) -> list[dict[str, Any]]:
    if not text and logprobs is None and reason is None:
        return []
    return [p.completion_choice(index, text, logprobs, reason)]


def _chat_deltas(index: int, text: str, logprobs: dict | None, reason: str | None) -> list[dict[str, Any]]:
    out = [p.chat_delta(index, {"content": text}, logprobs, None)] if text or logprobs is not None else []
    if reason is not None:
        out.append(p.chat_delta(index, {}, None, reason))
    return out


COMPLETIONS = _Endpoint(
    "cmpl", "text_completion", "text_completion", CompletionLogprobs, p.completion_choice,
    lambda index: [], _completion_deltas,
)  # fmt: skip
CHAT = _Endpoint(
    "chatcmpl", "chat.completion", "chat.completion.chunk", ChatLogprobs, p.chat_choice,
    lambda index: [p.chat_delta(index, {"role": "assistant", "content": ""}, None, None)], _chat_deltas,
)  # fmt: skip


def _check_model(ctx: AppContext, name: str | None) -> None:
    """vLLM answers a model it does not serve with a 404 (OpenAI's code: model_not_found)."""
    if name is not None and name not in ctx.served_names:
        served = ", ".join(map(repr, ctx.served_names))
        raise APIError(404, f"the model {clip(name)} does not exist; this server serves {served}", param="model",
                       code="model_not_found")  # fmt: skip


def _check_ids(ctx: AppContext, ids: list[int]) -> list[int]:
    limit = ctx.vocab_size
    bad = [t for t in ids if t < 0 or (limit is not None and t >= limit)]
    if bad:
        raise bad_request(
            f"token id {clip(bad[0])} is out of range [0, {limit or 'inf'})", "prompt", "invalid_token_id"
        )
    return ids


async def _collect(updates: ChoiceUpdates, request: Request) -> bool:
    """Run a non-streaming answer to its end; False when the client went away first.

    The client is checked every DISCONNECT_POLL_S of wall time (updates may arrive faster than that, so the
    check is not tied to a timeout). A timeout cancels only the wait on the updates' queue, which loses
    nothing."""
    loop = asyncio.get_running_loop()
    check_at = loop.time() + DISCONNECT_POLL_S
    while not updates.done:
        try:
            choice, update = await asyncio.wait_for(updates.get(), max(0.001, check_at - loop.time()))
            choice.advance(update)
        except TimeoutError:
            pass
        if loop.time() >= check_at:
            if await request.is_disconnected():
                return False
            check_at = loop.time() + DISCONNECT_POLL_S
    return True


async def _answer(
    ctx: AppContext,
    req: p.CompletionRequest | p.ChatCompletionRequest,
    request: Request,
    endpoint: _Endpoint,
    prompts: list[list[int]],
    max_tokens: int | None,
    logprobs: int | None,
) -> Response:
    """Submit each prompt `n` times, then answer with one JSON body or an SSE stream of chunks, the usage
    chunk if asked for, and [DONE]. Usage counts each prompt once and every choice's tokens."""
    requests = [(ids, req.sampling_params(max_tokens, logprobs, j)) for ids in prompts for j in range(req.n)]
    updates = ChoiceUpdates(await submit(ctx.engine, requests))
    rid, created, name = p.new_id(endpoint.id_prefix), p.now(), req.model or ctx.model_name

    def use() -> dict[str, int]:
        return p.usage(sum(map(len, prompts)), sum(c.handle.num_tokens for c in updates.choices))

    def final_logprobs(c: Choice) -> dict | None:
        return None if logprobs is None else endpoint.logprobs().add(c.logprobs)

    if not req.stream:
        try:
            if not await _collect(updates, request):
                return Response(status_code=499)
        finally:
            updates.close()
        choices = [endpoint.choice(c.index, c.text, final_logprobs(c), c.finish_reason) for c in updates.choices]
        return JSONResponse({**p.envelope(rid, created, name, endpoint.body_object, choices), "usage": use()})

    def chunk(choices: list[dict[str, Any]]) -> str:
        body = p.envelope(rid, created, name, endpoint.chunk_object, choices)
        return _sse({**body, "usage": None} if req.include_usage else body)

    async def events() -> AsyncIterator[str]:
        formatters = {c.index: endpoint.logprobs() for c in updates.choices}
        try:
            for c in updates.choices:
                for opening in endpoint.opening(c.index):
                    yield chunk([opening])
            async for c, update in updates:
                delta = c.advance(update)
                piece = formatters[c.index].add(update.logprobs) if logprobs is not None and update.token_ids else None
                for choice in endpoint.deltas(c.index, delta, piece, c.finish_reason):
                    yield chunk([choice])
            if req.include_usage:
                yield _sse({**p.envelope(rid, created, name, endpoint.chunk_object, []), "usage": use()})
        except APIError as e:
            yield _sse(error_body(e.message, e.type, e.param, e.code))
        yield _sse("[DONE]")

    return _AbortOnClose(events(), updates.close)


@router.get("/models")
async def models(ctx: Ctx) -> dict[str, Any]:
    info = ctx.engine.info
    cards = [
        p.ModelCard(id=name, root=info.model_root, max_model_len=info.max_model_len).model_dump()
        for name in ctx.served_names
    ]
    return {"object": "list", "data": cards}


@router.post("/completions", response_model=None, responses=ANSWER_RESPONSES)
async def completions(req: p.CompletionRequest, request: Request, ctx: Ctx) -> Response:
    _check_model(ctx, req.model)
    req.check_unsupported()
    prompts = [
        ctx.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
        if isinstance(prompt, str)
        else _check_ids(ctx, prompt)
        for prompt in req.prompts()
    ]
    return await _answer(ctx, req, request, COMPLETIONS, prompts, req.max_tokens, req.logprobs)


@router.post("/chat/completions", response_model=None, responses=ANSWER_RESPONSES)
async def chat(req: p.ChatCompletionRequest, request: Request, ctx: Ctx) -> Response:
    _check_model(ctx, req.model)
    req.check_unsupported()
    logprobs = req.engine_logprobs()
    try:
        prompt = ctx.tokenizer.apply_chat_template([m.as_template_input() for m in req.messages])
    except Exception as e:  # noqa: BLE001 - a template that rejects the conversation is the client's 400
        raise bad_request(f"cannot render the chat template: {shorten(str(e))}", "messages") from e
    ids = ctx.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
    return await _answer(ctx, req, request, CHAT, [ids], req.resolved_max_tokens(), logprobs)
