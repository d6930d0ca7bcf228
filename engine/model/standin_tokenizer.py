"""A stand-in tokenizer for backends without one (the twin), so HTTP clients and benchmark tools can
drive them with ordinary text requests.

Rules (deterministic, documented because token counts in usage and benchmarks follow from them):
- encode: one token per started 4 characters of the text (roughly what a BPE gives for English); each
  id is derived from its 4 characters, offset by 1000 so it never collides with low special ids.
- decode: every id becomes the filler word " the" (one token in common BPE vocabularies, so a client
  re-tokenizing the output with a real tokenizer counts the same number of tokens).
- chat template: `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`.
Stop strings apply to the filler text as to any text (the output processor decodes through this tokenizer).
"""

from __future__ import annotations

from typing import Any

from engine.model.tokenizer import compile_template, continue_final

CHARS_PER_TOKEN = 4
ID_BASE = 1000
ID_SPAN = 30000
FILLER = " the"


class StandInTokenizer:
    name = "stand-in"
    eos_token_ids: set[int] = set()
    bos_token_id = None
    vocab_size: int | None = None  # any non-negative id is accepted

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [
            ID_BASE + sum(map(ord, text[i : i + CHARS_PER_TOKEN])) % ID_SPAN
            for i in range(0, len(text), CHARS_PER_TOKEN)
        ]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return FILLER * len(ids)

    def added_tokens(self) -> dict[int, str]:
        return {}

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **variables: Any,
    ) -> str:
        """The rule above, or a request's own template (engine/model/tokenizer.py renders it, `variables` too)."""
        if chat_template is not None:
            variables = {**variables, "messages": messages, "add_generation_prompt": add_generation_prompt}
            text = compile_template(chat_template).render(variables)
        else:
            text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
            text += "<|assistant|>\n" if add_generation_prompt else ""
        return continue_final(text, messages[-1]["content"]) if continue_final_message else text
