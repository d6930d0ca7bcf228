"""Stop strings in a request's output text, found as vLLM's detokenizer finds them.

Each search covers only the text the new tokens added, plus the last len(stop) - 1 characters before it
(where a stop string that the new text completes can begin), so a request's stop checks cost time linear in
its output, not quadratic. While streaming, the tail that may still grow into a stop string is held back,
so no text that a later stop string cuts is ever sent.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]

    def __bool__(self) -> bool:
        return bool(self.stop)

    def find(self, text: str, new_from: int) -> tuple[int, str] | None:
        """The earliest stop string in `text` that ends after `new_from` (where this step's text begins):
        (where it begins, the string), or None."""
        hits = [(i, s) for s in self.stop if (i := text.find(s, max(0, new_from - len(s) + 1))) >= 0]
        return min(hits) if hits else None

    def held_back(self, text: str, start: int) -> int:
        """How many characters at the end of `text` (none before `start`, the text already sent) may be the
        start of a stop string: the stream holds them until the next tokens tell."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text) - start), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
