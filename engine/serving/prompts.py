"""An API request's prompts as the engine takes them: token ids (completions: the text encoded, with BOS by
default, or the ids checked against the vocabulary; chat: the conversation rendered by the chat template
with vLLM's template options), cut to vLLM's `truncate_prompt_tokens`, each with the text vLLM's `echo` puts
before its choices' text.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from engine.serving import protocol as p
from engine.serving.context import AppContext
from engine.serving.errors import bad_request, clip, shorten


class Prompt(NamedTuple):
    ids: list[int]
    echo: str  # what each of its choices' text starts with ("" without echo)


def check_ids(ctx: AppContext, ids: list[int]) -> list[int]:
    limit = ctx.vocab_size
    bad = [t for t in ids if t < 0 or (limit is not None and t >= limit)]
    if bad:
        raise bad_request(
            f"token id {clip(bad[0])} is out of range [0, {limit or 'inf'})", "prompt", "invalid_token_id"
        )
    return ids


def truncated(ctx: AppContext, req: p.SamplingFields, ids: list[int], max_tokens: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep k tokens (the last ones, or the first with truncation_side right);
    -1 keeps what the context leaves beside max_tokens, and a k above that is a 400."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    room = ctx.engine.info.max_model_len - (max_tokens or 0)
    if k > room:
        message = f"truncate_prompt_tokens={k} exceeds the {room} prompt tokens the context leaves"
        raise bad_request(message, "truncate_prompt_tokens")
    k = room if k < 0 else k
    if k >= len(ids):
        return ids
    return ids[:k] if req.truncation_side == "right" else ids[len(ids) - k :]


def completion_prompts(ctx: AppContext, req: p.CompletionRequest, max_tokens: int | None) -> list[Prompt]:
    """Each prompt; echo shows a text prompt as it was sent, and token ids (or a prompt that was truncated)
    decoded, as vLLM's renderer does."""
    prompts = []
    for prompt in req.prompts():
        text = isinstance(prompt, str)
        ids = (
            ctx.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens) if text else check_ids(ctx, prompt)
        )
        ids = truncated(ctx, req, ids, max_tokens)
        echo = ""
        if req.echo:
            as_sent = text and req.truncate_prompt_tokens is None
            echo = prompt if as_sent else ctx.tokenizer.decode(ids, skip_special_tokens=False)
        prompts.append(Prompt(ids, echo))
    return prompts


def template_options(req: p.ChatCompletionRequest, trust_template: bool) -> dict[str, Any]:
    """What the chat template is rendered with, merged as vLLM merges them: the request's kwargs, then its own
    fields over them; `enable_thinking` follows reasoning_effort unless the kwargs set it. A request's own
    template runs only where the operator trusts clients with one (`trust_template`): even sandboxed, a template
    is a program the server runs, and a costly one is a denial of service."""
    if req.chat_template is not None and not trust_template:
        message = "a request's own chat_template needs the server started with --trust-request-chat-template"
        raise bad_request(message, "chat_template")
    if req.continue_final_message and req.add_generation_prompt:
        message = "continue_final_message and add_generation_prompt cannot both be true"
        raise bad_request(message, "continue_final_message")
    options = dict(req.chat_template_kwargs or {})
    if taken := {"chat_template", "tokenize"} & options.keys():
        raise bad_request(f"chat_template_kwargs may not set {sorted(taken)}", "chat_template_kwargs")
    if req.reasoning_effort is not None:
        options.setdefault("enable_thinking", req.reasoning_effort != "none")
        options["reasoning_effort"] = req.reasoning_effort
    if req.documents is not None:
        options["documents"] = req.documents
    options["add_generation_prompt"] = req.add_generation_prompt
    options["continue_final_message"] = req.continue_final_message
    options["chat_template"] = req.chat_template
    options["tools"] = req.template_tools()  # engine/serving/tools.py; None: no tools
    return options


def chat_prompt(ctx: AppContext, req: p.ChatCompletionRequest, max_tokens: int | None) -> Prompt:
    """The conversation through the chat template; echo shows the last message where it has the answer's role
    (vLLM's chat echo)."""
    options = template_options(req, ctx.trust_request_chat_template)
    messages = [m.as_template_input() for m in req.messages]
    try:
        prompt = ctx.tokenizer.apply_chat_template(messages, **options)
    except Exception as e:  # noqa: BLE001 - a template that rejects the conversation is the client's 400
        raise bad_request(f"cannot render the chat template: {shorten(str(e))}", "messages") from e
    ids = truncated(ctx, req, ctx.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens), max_tokens)
    echo = req.echo and req.messages[-1].role == req.role
    return Prompt(ids, messages[-1]["content"] if echo else "")
