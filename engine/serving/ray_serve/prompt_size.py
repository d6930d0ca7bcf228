"""How many prompt tokens an OpenAI request body asks to prefill, and which leading part of it other requests
share, known before any replica tokenizes it.

The router must size a request at the ingress, which holds no tokenizer. The estimate follows the twin's
stand-in tokenizer exactly (one token per started 4 characters of the chat-templated text), and is the usual
~4 characters per token for a real BPE tokenizer: close enough to rank replicas, never used to admit.

The shared part is what a replica's prefix cache can reuse: a chat's leading system turns, or a plain prompt's
first `PREFIX_CHARS` characters. The router keys it by a digest and sends it back to the replica that has it
cached (headroom_policy.Affinity).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from engine.model.standin_tokenizer import CHARS_PER_TOKEN, StandInTokenizer

_TEMPLATE = StandInTokenizer()
PREFIX_CHARS = 1024  # a plain prompt's leading characters keyed as its shared prefix (~256 tokens)
MIN_PREFIX_TOKENS = 64  # a shorter shared part is not worth routing for


@dataclass(frozen=True)
class PromptSize:
    tokens: int  # prompt tokens the request would prefill (all prompts times `n`)
    prefix: str | None = None  # a digest of the leading text other requests may share
    prefix_tokens: int = 0  # the tokens that text covers


def _keyed(tokens: int, shared: str, shared_tokens: int) -> PromptSize:
    if shared_tokens < MIN_PREFIX_TOKENS:
        return PromptSize(tokens)
    return PromptSize(tokens, hashlib.blake2b(shared.encode(), digest_size=16).hexdigest(), shared_tokens)


def _tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _message_text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return _tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)  # token ids
    if isinstance(prompt, list):
        return sum(_prompt_tokens(p) for p in prompt)
    return 0


def _chat_size(messages: list[Any], n: int) -> PromptSize:
    turns = [{"role": str(m.get("role", "")), "content": _message_text(m.get("content"))}
             for m in messages if isinstance(m, dict)]  # fmt: skip
    system = 0
    while system < len(turns) and turns[system]["role"] == "system":
        system += 1
    shared = _TEMPLATE.apply_chat_template(turns[:system], add_generation_prompt=False)
    return _keyed(n * _tokens(_TEMPLATE.apply_chat_template(turns)), shared, len(shared) // CHARS_PER_TOKEN)


def size_prompt(body: bytes) -> PromptSize:
    """Tokens 0 for anything that is not a completion or chat body (the replica answers those, errors
    included)."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return PromptSize(0)
    if not isinstance(request, dict):
        return PromptSize(0)
    n = request.get("n", 1)
    n = n if isinstance(n, int) and n > 0 else 1
    messages = request.get("messages")
    if isinstance(messages, list):
        return _chat_size(messages, n)
    prompt = request.get("prompt")
    tokens = n * _prompt_tokens(prompt)
    if isinstance(prompt, str) and len(prompt) > PREFIX_CHARS:
        return _keyed(tokens, prompt[:PREFIX_CHARS], PREFIX_CHARS // CHARS_PER_TOKEN)
    return PromptSize(tokens)
