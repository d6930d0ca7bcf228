"""Request models and response bodies of the OpenAI completions and chat APIs, with vLLM's extensions.

Requests are validated strictly: a token id is an integer (not `false`, not `1.5`), a number is not a
string. So /openapi.json, which these models generate, says what the server accepts.

Unknown fields are ignored, as OpenAI-compatible servers do so that newer clients keep working, except
those in `UNSUPPORTED`: fields of OpenAI's or vLLM's API whose value would change the answer and that this
server does not implement (tools, response formats, logit bias, guided decoding, ...). Set to anything but a
harmless value, such a field is a 400 naming it, never silently dropped.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from engine.core.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.serving.errors import bad_request

MAX_N = 128  # OpenAI's bound on n: each choice is an engine request

# field -> the values that change nothing (None never does); any other value is a 400 naming the field
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "logit_bias": ({},),
    "suffix": ("",),
    "echo": (False,),
    "prompt_logprobs": (),
    "min_p": (0,),
    "use_beam_search": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "logits_processors": ([],),
    "truncate_prompt_tokens": (),
    "return_tokens_as_token_ids": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "documents": ([],),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "best_of": (1,),  # like vLLM v1: more samples than returned is not served
    "reasoning_effort": (),
    "audio": (),
    "modalities": (["text"],),
    "web_search_options": (),
}


def _integral(value: Any) -> Any:
    """JSON Schema's `integer` takes 3.0; strict mode otherwise refuses it (and still refuses true and "3")."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds: int) -> Any:
    """An integer field; its bounds go before the validator, or the schema would not show them."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


Int = integer()
Count = integer(ge=1)  # max_tokens and friends: at least one token
TOKEN_ID_MARK = "x-token-id"  # replaced by the vocabulary's bound in /openapi.json (bound_token_ids)
# The vocabulary check itself answers 400 `invalid_token_id` (openai_routes), so the bounds live in the
# schema only: pydantic would answer the same 400 with another code.
TokenId = Annotated[int, Field(json_schema_extra={"minimum": 0, TOKEN_ID_MARK: True}), BeforeValidator(_integral)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def bound_token_ids(schema: Any, vocab_size: int | None) -> Any:
    """Give every prompt token id in an OpenAPI schema the model's bound, so a schema-valid id is one the
    model has."""
    if isinstance(schema, dict):
        if schema.pop(TOKEN_ID_MARK, False) and vocab_size is not None:
            schema["maximum"] = vocab_size - 1
        for value in schema.values():
            bound_token_ids(value, vocab_size)
    elif isinstance(schema, list):
        for value in schema:
            bound_token_ids(value, vocab_size)
    return schema


TokenIdLists = Annotated[list[TokenIds], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]  # an empty prompt has no token to start from


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """The fields both endpoints share, with OpenAI's defaults; vLLM's extensions at the end."""

    model: str | None = None
    # Per-field bounds are in the schema, so a schema-valid request is one the engine takes.
    temperature: Annotated[float, Field(ge=0)] | None = None  # None: 1.0, as OpenAI
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: integer(ge=1, le=MAX_N) = 1
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None  # None: 0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None  # None: 0
    # vLLM extensions
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None  # None: 1 (off)
    top_k: integer(ge=-1) | None = None
    ignore_eos: bool = False
    min_tokens: integer(ge=0) = 0
    stop_token_ids: list[integer(ge=0)] | None = None
    include_stop_str_in_output: bool = False

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise bad_request("stop strings must not be empty", "stop")
        return stops

    def check_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            harmless = UNSUPPORTED.get(name)
            if harmless is not None and value is not None and value not in harmless:
                allowed = ", ".join(map(repr, harmless)) or "null"
                raise bad_request(
                    f"{name} is not supported by this server (accepted only as: {allowed})", name, "unsupported_field"
                )

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, sample: int) -> SamplingParams:
        """Engine parameters for the `sample`-th choice of a prompt: with `seed`, sample j uses seed + j, as
        vLLM's parallel sampling does. Range checks run in the engine (RequestError -> 400 with `param`)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=None if self.seed is None else self.seed + sample,
            stop=self.stop_list(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1)] | TokenIdLists
    max_tokens: Count | None = 16  # OpenAI's default for completions
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None  # top k besides the chosen token
    add_special_tokens: bool = True  # vLLM: completions get BOS

    def prompts(self) -> list[str | list[int]]:
        """Each prompt, as text or token ids (one prompt is a batch of one)."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(Strict):
    type: Literal["text"]  # image and audio parts would change the answer: not served, so not in the schema
    text: str


Content = str | list[TextPart]


class _Message(Strict):
    """A chat message, one class per role so the schema says what each role needs (a schema-valid message is
    one the server takes)."""

    role: str
    content: Content | None = None
    tool_call_id: str | None = None  # tool messages answer this call
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, as the template may render them

    def as_template_input(self) -> dict[str, Any]:
        """What the chat template sees: `developer` is OpenAI's newer name for `system`."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content}
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


class InstructionMessage(_Message):
    role: Literal["system", "developer", "user"]
    content: Content


class AssistantMessage(_Message):
    """OpenAI: content is required unless the turn called tools. The schema says it with anyOf, the
    validator enforces it."""

    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array"}}},
            ]
        }
    )
    role: Literal["assistant"]
    tool_calls: Annotated[list[dict[str, Any]], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> AssistantMessage:
        if self.content is None and self.tool_calls is None:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


ChatMessage = Annotated[InstructionMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None
    add_special_tokens: bool = False  # vLLM: the chat template already writes BOS

    def resolved_max_tokens(self) -> int | None:
        """None means 'up to the context' (OpenAI's chat default)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_logprobs(self) -> int | None:
        """The engine's k (top entries besides the chosen token), or None when logprobs are off."""
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses ---------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(rid: str, created: int, model: str, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """What every body and chunk of one answer shares."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta(index: int, delta: dict[str, str], logprobs: dict | None, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "headroom"
    root: str | None = None  # the model behind the name
    max_model_len: int | None = None
