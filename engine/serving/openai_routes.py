"""The OpenAI API: /v1/models, /v1/completions and /v1/chat/completions, streaming and not.

Handlers never touch the engine directly: they check what the engine does not (model name, unsupported
fields, token ids), tokenize, submit one engine request per choice (`choices.submit`: each prompt times
`n`) and turn the merged messages (text deltas and logprob entries, decoded on the engine thread) into
answers, so streamed deltas and non-streamed bodies come from the same text. `_Endpoint` holds what differs
between the two endpoints, `_Shape` what vLLM's options add to an answer beyond each choice's text (echo,
prompt logprobs, token ids for token texts, the role); engine/serving/prompts.py makes the prompts. An answer
names the model as the client asked for it (any served name), as vLLM's does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.core.sampling_params import ParamError, StructuredOutput
from engine.frontend.bad_words import bad_words_token_ids
from engine.frontend.output_processor import Resume
from engine.serving import answer_bodies as bodies
from engine.serving import protocol as p
from engine.serving.beam_search import search
from engine.serving.choices import Choice, ChoiceUpdates, submit
from engine.serving.context import AppContext, Ctx, require_key
from engine.serving.errors import APIError, bad_request, clip, error_body, error_responses
from engine.serving.logprobs import ChatLogprobs, CompletionLogprobs, prompt_logprobs
from engine.serving.messages import LogprobEntry
from engine.serving.prompts import Prompt, chat_prompt, completion_prompts
from engine.serving.structured_fields import structured_of
from engine.serving.tools import ChoiceStream, ToolPlan, answer_message

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

    def __init__(self, content: AsyncIterator[str], close: Callable[[], None], resumable: bool) -> None:
        headers = {"Cache-Control": "no-cache"} | ({bodies.RESUMABLE_HEADER: "1"} if resumable else {})
        super().__init__(content, media_type="text/event-stream", headers=headers)
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
    deltas: Callable[[int, str, dict | None, str | None], list[dict[str, Any]]]  # a stream's, per update


def _completion_deltas(index: int, text: str, logprobs: dict | None, reason: str | None) -> list[dict[str, Any]]:
    if not text and logprobs is None and reason is None:
        return []
    return [bodies.completion_choice(index, text, logprobs, reason)]


def _chat_deltas(index: int, text: str, logprobs: dict | None, reason: str | None) -> list[dict[str, Any]]:
    out = [bodies.chat_delta(index, {"content": text}, logprobs, None)] if text or logprobs is not None else []
    if reason is not None:
        out.append(bodies.chat_delta(index, {}, None, reason))
    return out


COMPLETIONS = _Endpoint(
    "cmpl", "text_completion", "text_completion", CompletionLogprobs, bodies.completion_choice, _completion_deltas
)
CHAT = _Endpoint("chatcmpl", "chat.completion", "chat.completion.chunk", ChatLogprobs, bodies.chat_choice, _chat_deltas)


@dataclass(frozen=True)
class _Shape:
    """What an answer shows beyond each choice's text: vLLM's options."""

    logprobs: int | None  # the output tokens' top k; None: no logprobs
    prompt_logprobs: int | None  # the engine's: the prompt is scored, and the answer carries `prompt_logprobs`
    echo_logprobs: bool = False  # completions' echo with logprobs: the prompt's logprobs lead each choice's
    generates: bool = True  # False: echo with max_tokens 0, the answer is the prompt alone
    as_ids: bool = False  # return_tokens_as_token_ids
    role: str = "assistant"  # chat: the answer's role
    tools: ToolPlan | None = None  # chat: the tool calls its text holds (engine/serving/tools.py)


@dataclass
class _Result:
    """One choice as an answer's body shows it."""

    index: int
    text: str
    logprobs: list[LogprobEntry]
    finish_reason: str | None
    token_ids: list[int]
    prompt_logprobs: list[LogprobEntry] | None = None


def _check_model(ctx: AppContext, name: str | None) -> None:
    """vLLM answers a model it does not serve with a 404 (OpenAI's code: model_not_found)."""
    if name is not None and name not in ctx.served_names:
        served = ", ".join(map(repr, ctx.served_names))
        raise APIError(404, f"the model {clip(name)} does not exist; this server serves {served}", param="model",
                       code="model_not_found")  # fmt: skip


class _Answer:
    """One answer to a request, its shape and its prompts: submitted (each prompt `n` times) or beam-searched,
    then made into one JSON body, or an SSE stream of chunks, the usage chunk if asked for, and [DONE]. Usage
    counts each prompt once and every choice's tokens."""

    def __init__(self, ctx: AppContext, req: p.CompletionRequest | p.ChatCompletionRequest, endpoint: _Endpoint,
                 prompts: list[Prompt], shape: _Shape, structured: StructuredOutput | None = None) -> None:  # fmt: skip
        self.ctx, self.req, self.endpoint, self.prompts, self.shape = ctx, req, endpoint, prompts, shape
        self.structured = structured  # the grammar every choice keeps to (engine/core/structured.py)
        self.rid = f"{endpoint.id_prefix}-{req.request_id}" if req.request_id else bodies.new_id(endpoint.id_prefix)
        self.created, self.name = bodies.now(), req.model or ctx.model_name

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return bodies.usage(sum(len(prompt.ids) for prompt in self.prompts), completion_tokens)

    def body(self, results: list[_Result], completion_tokens: int) -> JSONResponse:
        shape, endpoint = self.shape, self.endpoint
        choices = []
        for r in results:
            text = self.prompts[r.index // self.req.n].echo + (r.text if shape.generates else "")
            logprobs = None
            if shape.logprobs is not None:
                lead = (r.prompt_logprobs or []) if shape.echo_logprobs else []
                logprobs = endpoint.logprobs(shape.as_ids).add([*lead, *(r.logprobs if shape.generates else [])])
            choice = endpoint.choice(r.index, text, logprobs, r.finish_reason)
            if endpoint is CHAT:
                choice["message"]["role"] = shape.role
                if shape.tools is not None:
                    fields, choice["finish_reason"] = answer_message(shape.tools, text, r.finish_reason)
                    choice["message"].update(fields)
            elif shape.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs(r.prompt_logprobs or [])
            if self.req.return_token_ids:
                choice["token_ids"] = r.token_ids
                if endpoint is COMPLETIONS:
                    choice["prompt_token_ids"] = self.prompts[r.index // self.req.n].ids
            choices.append(choice)
        body = bodies.envelope(self.rid, self.created, self.name, endpoint.body_object, choices)
        if endpoint is CHAT and shape.prompt_logprobs is not None and results:
            body["prompt_logprobs"] = prompt_logprobs(results[0].prompt_logprobs or [])
        if endpoint is CHAT and self.req.return_token_ids:
            body["prompt_token_ids"] = self.prompts[0].ids
        return JSONResponse({**body, "usage": self.usage(completion_tokens)})

    async def respond(self, request: Request, max_tokens: int | None) -> Response:
        req, ctx = self.req, self.ctx
        if req.use_beam_search:
            return await self.beams(request, max_tokens)
        try:
            bad_words = bad_words_token_ids(req.bad_words, ctx.tokenizer) if req.bad_words else None
        except ParamError as e:
            raise bad_request(str(e), e.param) from e
        first = req.sampling_params(max_tokens, self.shape.logprobs, self.shape.prompt_logprobs, bad_words)
        first = replace(first, structured=self.structured)
        requests = [(prompt.ids, req.for_sample(first, j)) for prompt in self.prompts for j in range(req.n)]
        updates = ChoiceUpdates(await submit(ctx.engine, requests, self.resume()))
        if req.stream:
            return _AbortOnClose(self.events(updates), updates.close, self.resumable)
        try:
            scored = await _collect(updates, request)
        finally:
            updates.close()
        if scored is None:
            return Response(status_code=499)
        results = [
            _Result(c.index, c.text, c.logprobs, c.finish_reason, c.token_ids, scored.get(c.index))
            for c in updates.choices
        ]
        return self.body(results, sum(c.handle.num_tokens for c in updates.choices))

    def resume(self) -> Resume | None:
        """The request's `resume`, for a stream that can go on here: its text the output's alone (no tool calls
        parsed from it) and no grammar to catch up."""
        resume = self.req.resume
        if resume is None:
            return None
        if not self.resumable:  # the request's own rules held (check_rules): tools or a grammar are left
            raise bad_request("a stream with tools or a structured output does not resume", "resume")
        return Resume(tuple(resume.token_ids), resume.text_sent)

    @property
    def resumable(self) -> bool:
        """What the fleet's ingress may resume elsewhere if this replica dies (the `x-headroom-resumable` header)."""
        return self.req.resumable and self.shape.tools is None and self.structured is None

    async def beams(self, request: Request, max_tokens: int | None) -> Response:
        """vLLM's beam search (engine/serving/beam_search.py); n is the width."""
        if self.shape.prompt_logprobs is not None:
            raise bad_request("beam search answers without prompt logprobs (and so without echo's)", "use_beam_search")
        ids = [prompt.ids for prompt in self.prompts]
        found = await search(
            self.ctx.engine, self.ctx.tokenizer, self.req, ids, max_tokens, self.shape.logprobs or 0,
            request.is_disconnected,
        )  # fmt: skip
        if await request.is_disconnected():
            return Response(status_code=499)
        n = self.req.n
        results = [
            _Result(i * n + j, b.text, b.logprobs, b.finish_reason, b.token_ids)
            for i, beams in enumerate(found)
            for j, b in enumerate(beams)
        ]
        return self.body(results, sum(len(b.token_ids) for beams in found for b in beams))

    def _chunk(self, choices: list[dict[str, Any]]) -> str:
        body = bodies.envelope(self.rid, self.created, self.name, self.endpoint.chunk_object, choices)
        return _sse({**body, "usage": None} if self.req.include_usage else body)

    def _opening(self, choice: Choice) -> list[str]:
        """A chat stream opens each choice with its role, then the echoed message (vLLM's chat echo)."""
        if self.endpoint is not CHAT:
            return []
        echo = self.prompts[choice.index // self.req.n].echo
        chunks = [self._chunk([bodies.chat_delta(choice.index, {"role": self.shape.role, "content": ""}, None, None)])]
        return chunks + (
            [self._chunk([bodies.chat_delta(choice.index, {"content": echo}, None, None)])] if echo else []
        )

    async def events(self, updates: ChoiceUpdates) -> AsyncIterator[str]:
        shape, echoed = self.shape, set()
        as_ids = shape.as_ids
        pieces = {} if shape.logprobs is None else {c.index: self.endpoint.logprobs(as_ids) for c in updates.choices}
        tools = {c.index: ChoiceStream(shape.tools) for c in updates.choices} if shape.tools is not None else {}
        try:
            for c in updates.choices if self.req.resume is None else ():  # a resumed stream has opened
                for chunk in self._opening(c):
                    yield chunk
            async for c, update in updates:
                text, entries = c.advance(update), update.logprobs
                if not shape.generates:
                    text, entries = "", []
                if self.endpoint is COMPLETIONS and c.index not in echoed:  # its first chunk leads with the echo
                    echoed.add(c.index)
                    lead = (update.prompt_logprobs or []) if shape.echo_logprobs else []
                    text, entries = self.prompts[c.index // self.req.n].echo + text, [*lead, *entries]
                piece = pieces[c.index].add(entries) if pieces and entries else None
                deltas = tools[c.index].deltas if tools else self.endpoint.deltas
                choices = deltas(c.index, text, piece, c.finish_reason)
                if self.req.return_token_ids and update.token_ids:  # each step's ids, in its first chunk
                    choices = choices or self.endpoint.deltas(c.index, "", {}, None)
                    choices[0]["token_ids"] = update.token_ids
                for choice in choices:
                    yield self._chunk([choice])
            if self.req.include_usage:
                tokens = sum(c.handle.num_tokens for c in updates.choices)
                body = bodies.envelope(self.rid, self.created, self.name, self.endpoint.chunk_object, [])
                yield _sse({**body, "usage": self.usage(tokens)})
        except APIError as e:
            yield _sse(error_body(e.message, e.type, e.param, e.code))
        yield _sse("[DONE]")


async def _collect(updates: ChoiceUpdates, request: Request) -> dict[int, list[LogprobEntry]] | None:
    """Run a non-streaming answer to its end; returns each choice's prompt logprobs (where the engine scored
    its prompt), or None when the client went away first.

    The client is checked every DISCONNECT_POLL_S of wall time (updates may arrive faster than that, so the
    check is not tied to a timeout). A timeout cancels only the wait on the updates' queue, which loses
    nothing."""
    loop = asyncio.get_running_loop()
    check_at = loop.time() + DISCONNECT_POLL_S
    scored: dict[int, list[LogprobEntry]] = {}
    while not updates.done:
        try:
            choice, update = await asyncio.wait_for(updates.get(), max(0.001, check_at - loop.time()))
            choice.advance(update)
            if update.prompt_logprobs is not None:
                scored[choice.index] = update.prompt_logprobs
        except TimeoutError:
            pass
        if loop.time() >= check_at:
            if await request.is_disconnected():
                return None
            check_at = loop.time() + DISCONNECT_POLL_S
    return scored


@router.get("/models")
async def models(ctx: Ctx) -> dict[str, Any]:
    info = ctx.engine.info
    cards = [
        bodies.ModelCard(id=name, root=info.model_root, max_model_len=info.max_model_len).model_dump()
        for name in ctx.served_names
    ]
    return {"object": "list", "data": cards}


@router.post("/completions", response_model=None, responses=ANSWER_RESPONSES)
async def completions(req: p.CompletionRequest, request: Request, ctx: Ctx) -> Response:
    _check_model(ctx, req.model)
    req.check_unsupported()
    req.check_rules()
    max_tokens = req.engine_max_tokens()
    prompts = completion_prompts(ctx, req, max_tokens)
    as_ids = bool(req.return_tokens_as_token_ids)
    echo_logprobs = req.echo and req.logprobs is not None
    shape = _Shape(req.logprobs, req.engine_prompt_logprobs(), echo_logprobs, req.generates, as_ids)
    structured = await structured_of(ctx, req)
    return await _Answer(ctx, req, COMPLETIONS, prompts, shape, structured).respond(request, max_tokens)


@router.post("/chat/completions", response_model=None, responses=ANSWER_RESPONSES)
async def chat(req: p.ChatCompletionRequest, request: Request, ctx: Ctx) -> Response:
    _check_model(ctx, req.model)
    req.check_unsupported()
    req.check_rules()
    logprobs = req.engine_logprobs()
    max_tokens = req.resolved_max_tokens()
    tools = req.tool_plan(ctx.tool_call_parser)
    prompt = chat_prompt(ctx, req, max_tokens)
    as_ids = bool(req.return_tokens_as_token_ids)
    shape = _Shape(logprobs, req.engine_prompt_logprobs(), as_ids=as_ids, role=req.role, tools=tools)
    structured = await structured_of(ctx, req, tools)
    return await _Answer(ctx, req, CHAT, [prompt], shape, structured).respond(request, max_tokens)
