"""Output text for one request, streamed so that the concatenated deltas equal the non-streaming text.

Two things make naive per-token decoding wrong: a token can end inside a multi-byte UTF-8 character
(decoded alone it is U+FFFD), and a stop string cuts the text *before* itself, so a stream must not send
text that may turn out to be the start of a stop string. `IncrementalDetokenizer` handles the first; this
module holds back the second. The final text is what the engine decided: the decoded output cut at
`Sequence.stop_text_len` (the engine found the stop string in `decode(output_ids)`); `finish()` sends
whatever of it the stream has not sent yet.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.model.tokenizer import IncrementalDetokenizer

logger = logging.getLogger("headroom.server")


class TextStream:
    def __init__(self, tokenizer: Any, stop: list[str] | None = None) -> None:
        self._tokenizer = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = [s for s in stop or [] if s]
        self.token_ids: list[int] = []
        self.sent = ""  # text sent so far (a prefix of the final text)
        self.final: str | None = None

    def add(self, token_ids: list[int]) -> str:
        """Feed new output tokens; returns the text that is now safe to send (possibly empty)."""
        for t in token_ids:
            self._detok.add(t)
        self.token_ids.extend(token_ids)
        text = self._detok.text
        limit = self._safe_limit(text)
        if limit <= len(self.sent):
            return ""
        delta = text[len(self.sent) : limit]
        self.sent += delta
        return delta

    def _safe_limit(self, text: str) -> int:
        """Length of the prefix of `text` that no stop string can cut: up to the first complete stop string,
        and short of any suffix that is the start of one. A stop string can never begin inside text already
        sent, so the search starts there."""
        limit = len(text)
        start = len(self.sent)
        for s in self._stop:
            i = text.find(s, start)
            if i >= 0:
                limit = min(limit, i)
                continue
            for k in range(min(len(s) - 1, len(text) - start), 0, -1):
                if text.endswith(s[:k]):
                    limit = min(limit, len(text) - k)
                    break
        return limit

    def finish(self, stop_text_len: int | None) -> str:
        """The request ended: returns the rest of the final text."""
        final = self._tokenizer.decode(self.token_ids)
        if stop_text_len is not None:
            final = final[:stop_text_len]
        if not final.startswith(self.sent):  # cannot happen for byte-level BPE; say so if it ever does
            logger.warning("streamed text diverged from the final text: %r vs %r", self.sent, final)
        self.final = final
        delta = final[len(self.sent) :]
        self.sent += delta
        return delta
