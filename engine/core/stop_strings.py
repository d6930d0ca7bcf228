"""Stop strings found as a request's output is detokenized, as vLLM's detokenizer finds them: each step
searches only the text its new tokens added, plus the last len(stop) - 1 characters before it (where a stop
string that the new text completes can begin). Nothing is decoded twice, so a request's stop checks cost
time linear in its output, not quadratic."""

from __future__ import annotations

from engine.model.tokenizer import IncrementalDetokenizer, Tokenizer


class StopStringMatcher:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = [s for s in stop if s]
        self._overlap = max(map(len, self._stop), default=1) - 1
        self._tail = ""  # the last `_overlap` characters of the text so far
        self._text_len = 0  # characters of the output text so far
        self._num_fed = 0  # output tokens given to the detokenizer

    def update(self, output_ids: list[int], search: bool = True) -> int | None:
        """Detokenize the tokens appended to `output_ids` since the last call. With `search` (off while the
        request is under min_tokens), returns where the earliest stop string in the new text begins, in
        characters of the whole output text (the text is cut there), or None."""
        new = "".join(self._detok.add(t) for t in output_ids[self._num_fed :])
        self._num_fed = len(output_ids)
        if not new:
            return None
        window, window_start = self._tail + new, self._text_len - len(self._tail)
        self._text_len += len(new)
        self._tail = window[-self._overlap :] if self._overlap else ""
        if not search:
            return None
        first_new = len(window) - len(new)
        hits = [i for s in self._stop if (i := window.find(s, max(0, first_new - len(s) + 1))) >= 0]
        return window_start + min(hits) if hits else None
