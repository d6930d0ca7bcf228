"""Token logprobs in OpenAI's two shapes, from the output processor's `LogprobEntry`s (texts decoded on the
engine thread: nothing here decodes).

- Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where each
  `top_logprobs` entry maps token text to logprob for the top k and the chosen token (as vLLM does).
- Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.

A token's text is its own decode (special tokens included), and `bytes` its UTF-8 encoding, as vLLM writes
them. A stream sends each chunk's tokens with the chunk; `text_offset` then continues across chunks.
"""

from __future__ import annotations

from typing import Any

from engine.serving.messages import LogprobEntry

LOGPROB_FLOOR = -9999.0  # vLLM's clamp: -inf is not valid JSON


def _value(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class CompletionLogprobs:
    """One completion choice's legacy logprobs object, piece by piece."""

    def __init__(self) -> None:
        self._offset = 0  # text offset of the next token

    def add(self, entries: list[LogprobEntry]) -> dict[str, Any]:
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(e.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [_value(e.logprob) for e in entries],
            "top_logprobs": [{**{t: _value(lp) for t, lp in e.top}, e.token: _value(e.logprob)} for e in entries],
            "text_offset": offsets,
        }


class ChatLogprobs:
    """One chat choice's `logprobs.content` entries, piece by piece."""

    @staticmethod
    def _entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}

    def add(self, entries: list[LogprobEntry]) -> dict[str, Any]:
        content = [
            {**self._entry(e.token, e.logprob), "top_logprobs": [self._entry(t, lp) for t, lp in e.top]}
            for e in entries
        ]
        return {"content": content}
