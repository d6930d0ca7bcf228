"""The bodies of the OpenAI completions and chat answers: each choice, the envelope every body and chunk of one
answer shares, usage, and the model list's cards."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, Field

RESUMABLE_HEADER = "x-headroom-resumable"  # on a stream the fleet's ingress may resume on another replica


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
