"""Token logprobs in OpenAI's two shapes and vLLM's prompt logprobs, from the output processor's `LogprobEntry`s
(texts decoded on the engine thread: nothing here decodes).

- Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where each
  `top_logprobs` entry maps token text to logprob for the top k and the chosen token (as vLLM does). With
  `echo`, the prompt's tokens lead, the first with null logprobs (nothing comes before it).
- Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
- vLLM's `prompt_logprobs`: per prompt token null for the first, else `{token id: {"logprob", "rank",
  "decoded_token"}}` for the token and the top k.

A token's text is its own decode (special tokens included), and `bytes` its UTF-8 encoding, as vLLM writes
them; with `return_tokens_as_token_ids` it is `token_id:N` instead, so a token that is not valid UTF-8 alone
can still be told apart. A stream sends each chunk's tokens with the chunk; `text_offset` then continues
across chunks.
"""

from __future__ import annotations

from typing import Any

from engine.serving.messages import LogprobEntry

LOGPROB_FLOOR = -9999.0  # vLLM's clamp: -inf is not valid JSON


def _value(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class _Tokens:
    """How a formatter names tokens: their text, or `token_id:N` (return_tokens_as_token_ids)."""

    def __init__(self, as_ids: bool = False) -> None:
        self.as_ids = as_ids

    def chosen(self, e: LogprobEntry) -> str:
        return f"token_id:{e.token_id}" if self.as_ids else e.token

    def top(self, e: LogprobEntry) -> list[tuple[str, float]]:
        if self.as_ids:
            return [(f"token_id:{i}", lp) for i, (_, lp) in zip(e.top_ids, e.top, strict=True)]
        return e.top


class CompletionLogprobs(_Tokens):
    """One completion choice's legacy logprobs object, piece by piece."""

    def __init__(self, as_ids: bool = False) -> None:
        super().__init__(as_ids)
        self._offset = 0  # text offset of the next token

    def add(self, entries: list[LogprobEntry]) -> dict[str, Any]:
        tokens, offsets = [self.chosen(e) for e in entries], []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e.logprob is None else _value(e.logprob) for e in entries],
            "top_logprobs": [
                None if e.logprob is None else {**{t: _value(lp) for t, lp in self.top(e)}, token: _value(e.logprob)}
                for token, e in zip(tokens, entries, strict=True)
            ],
            "text_offset": offsets,
        }


class ChatLogprobs(_Tokens):
    """One chat choice's `logprobs.content` entries, piece by piece."""

    @staticmethod
    def _entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}

    def add(self, entries: list[LogprobEntry]) -> dict[str, Any]:
        content = [
            {**self._entry(self.chosen(e), e.logprob), "top_logprobs": [self._entry(t, lp) for t, lp in self.top(e)]}
            for e in entries
        ]
        return {"content": content}


def prompt_logprobs(entries: list[LogprobEntry]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`, keyed as vLLM's are: the token first, then the top k (a top entry for the
    token itself replaces its own, as in vLLM's dict)."""

    def item(logprob: float, rank: int | None, text: str) -> dict[str, Any]:
        return {"logprob": _value(logprob), "rank": rank, "decoded_token": text}

    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        scored = {str(e.token_id): item(e.logprob, e.rank, e.token)}
        for rank, (token_id, (text, lp)) in enumerate(zip(e.top_ids, e.top, strict=True), 1):
            scored[str(token_id)] = item(lp, rank, text)
        out.append(scored)
    return out
