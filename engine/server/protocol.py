"""Request models and response bodies of the OpenAI completions and chat APIs (the subset we serve).

Unknown fields are ignored (as OpenAI-compatible servers do, so newer clients keep working), but fields
whose non-default value would change the answer and that we do not implement (n > 1, echo, logprobs,
penalties, best_of) are rejected with a 400 by `check_unsupported` instead of being silently dropped.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import SamplingParams
from engine.server.errors import bad_request


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields both endpoints share, with OpenAI's defaults; vLLM's extensions at the end."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: int = 0

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise bad_request("stop strings must not be empty", "stop")
        return stops

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise bad_request(f"only n=1 is supported, got n={self.n}", "n", "unsupported_value")
        if self.logprobs not in (None, False):
            raise bad_request("logprobs are not supported", "logprobs", "unsupported_value")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported (only 0)", name, "unsupported_value")

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """Engine parameters; their range checks run in the engine (RequestError -> 400 with `param`)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=self.stop_list(),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise bad_request("echo is not supported", "echo", "unsupported_value")
        if self.best_of not in (None, 1):
            raise bad_request("best_of is not supported", "best_of", "unsupported_value")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported_value")

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string or token ids (a batch of one is unwrapped; larger batches are 400)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise bad_request("batched prompts are not supported: send one prompt per request", "prompt")
            return p[0]  # type: ignore[return-value]
        return p  # type: ignore[return-value]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_input(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens

    def resolved_max_tokens(self) -> int | None:
        """None means 'up to the context' (OpenAI's chat default)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


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


def completion_body(
    rid: str, created: int, model: str, text: str, finish_reason: str | None, use: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": use,
    }


def completion_chunk(
    rid: str, created: int, model: str, text: str, finish_reason: str | None, with_usage: bool
) -> dict[str, Any]:
    body = completion_body(rid, created, model, text, finish_reason, {})
    if with_usage:
        body["usage"] = None
    else:
        del body["usage"]
    return body


def chat_body(
    rid: str, created: int, model: str, text: str, finish_reason: str | None, use: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": use,
    }


def chat_chunk(
    rid: str, created: int, model: str, delta: dict[str, str], finish_reason: str | None, with_usage: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if with_usage:
        body["usage"] = None
    return body


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict[str, int]) -> dict[str, Any]:
    """The final chunk of a stream with include_usage: no choices, only usage (as OpenAI sends it)."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "headroom"
    max_model_len: int | None = None
