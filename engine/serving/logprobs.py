"""Token logprobs in OpenAI's two shapes, from the engine's `TokenLogprob` entries.

- Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where each
  `top_logprobs` entry maps token text to logprob for the top k and the chosen token (as vLLM does).
- Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.

A token's text is its own decode (special tokens included), and `bytes` its UTF-8 encoding, as vLLM writes
them. A stream sends each chunk's tokens with the chunk; `text_offset` then continues across chunks.
"""

from __future__ import annotations

from typing import Any

from engine.core.sequence import TokenLogprob

LOGPROB_FLOOR = -9999.0  # vLLM's clamp: -inf is not valid JSON


def _value(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class _Formatter:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


class CompletionLogprobs(_Formatter):
    """One completion choice's legacy logprobs object, piece by piece."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._offset = 0  # text offset of the next token

    def add(self, token_ids: list[int], entries: list[TokenLogprob]) -> dict[str, Any]:
        tokens = [self.token(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(self._offset)
            self._offset += len(text)
        top = [
            {**{self.token(i): _value(lp) for i, lp in e.top}, text: _value(e.logprob)}
            for text, e in zip(tokens, entries, strict=True)
        ]
        return {
            "tokens": tokens,
            "token_logprobs": [_value(e.logprob) for e in entries],
            "top_logprobs": top,
            "text_offset": offsets,
        }


class ChatLogprobs(_Formatter):
    """One chat choice's `logprobs.content` entries, piece by piece."""

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}

    def add(self, token_ids: list[int], entries: list[TokenLogprob]) -> dict[str, Any]:
        content = [
            {**self._entry(t, e.logprob), "top_logprobs": [self._entry(i, lp) for i, lp in e.top]}
            for t, e in zip(token_ids, entries, strict=True)
        ]
        return {"content": content}
