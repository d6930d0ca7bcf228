"""How many prompt tokens an OpenAI request body asks to prefill, known before any replica tokenizes it.

The router must size a request at the ingress, which holds no tokenizer. The estimate follows the twin's
stand-in tokenizer exactly (one token per started 4 characters of the chat-templated text), and is the usual
~4 characters per token for a real BPE tokenizer: close enough to rank replicas, never used to admit.
"""

from __future__ import annotations

import json
import math
from typing import Any

from engine.serving.standin import CHARS_PER_TOKEN, StandInTokenizer

_TEMPLATE = StandInTokenizer()


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


def prompt_tokens(body: bytes) -> int:
    """Prompt tokens the request would prefill (all prompts times `n`); 0 for anything that is not a
    completion or chat body (the replica answers those, errors included)."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return 0
    if not isinstance(request, dict):
        return 0
    n = request.get("n", 1)
    n = n if isinstance(n, int) and n > 0 else 1
    messages = request.get("messages")
    if isinstance(messages, list):
        turns = [{"role": str(m.get("role", "")), "content": _message_text(m.get("content"))}
                 for m in messages if isinstance(m, dict)]  # fmt: skip
        return n * _tokens(_TEMPLATE.apply_chat_template(turns))
    return n * _prompt_tokens(request.get("prompt"))
