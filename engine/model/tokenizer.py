"""Tokenizer: a `tokenizers` BPE plus the model's jinja2 chat template, and a streaming detokenizer.

A chat template, the model's or a request's own (vLLM's `chat_template`), runs in jinja2's immutable sandbox,
with limits a template that a client wrote must not get past: ranges of at most jinja2's MAX_RANGE items and
RENDER_BUDGET items in all, and no string, list or number grown by `+`, `*` or `**` past TEMPLATE_MAX_SIZE.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from engine.model.tool_template import with_tools


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    """HF's override: jinja2's own tojson HTML-escapes, which changes the prompt."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


RENDER_BUDGET = 1_000_000  # range items one render may create, nested loops included
TEMPLATE_MAX_SIZE = 1 << 20  # characters or items a `+`, `*` or `**` may produce; digits for `**`
_render = threading.local()  # the budget left to the render running on this thread


def _budgeted_range(*args: int) -> range:
    rng = safe_range(*args)
    _render.left = getattr(_render, "left", RENDER_BUDGET) - len(rng)
    if _render.left < 0:
        raise jinja2.exceptions.SecurityError(f"the template iterates over more than {RENDER_BUDGET} items")
    return rng


def _size_after(operator: str, left: Any, right: Any) -> float:
    """A bound on the size of `left operator right` before it is computed: its length, or digits for `**`."""
    if operator == "+" and hasattr(left, "__len__") and hasattr(right, "__len__"):
        return len(left) + len(right)
    if operator == "*":
        seq, count = (left, right) if hasattr(left, "__len__") else (right, left)
        return len(seq) * count if hasattr(seq, "__len__") and isinstance(count, int) else 0
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
        return right * len(str(abs(left)))
    return 0


class _TemplateSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with the size limits of the module docstring on `+`, `*` and `**`."""

    intercepted_binops = frozenset({"+", "*", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if _size_after(operator, left, right) > TEMPLATE_MAX_SIZE:
            raise jinja2.exceptions.SecurityError(f"the template grows a value past {TEMPLATE_MAX_SIZE}")
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """A chat template in the sandbox with HF's globals and filters; the same source compiles once."""
    env = _TemplateSandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["range"] = _budgeted_range
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def continue_final(rendered: str, final: str) -> str:
    """HF's `continue_final_message` (which vLLM calls): the render cut right after the final message's text,
    so the model continues it instead of starting a turn. A template that dropped the text is an error."""
    stripped = final.strip()
    at = rendered.rfind(stripped)
    if at < 0:
        raise ValueError("continue_final_message: the final message does not appear in the rendered chat")
    if rendered[at : at + len(final.lstrip())] == final:  # the template kept the message's spacing
        return rendered[: at + len(final.lstrip())]
    return rendered[: at + len(stripped)]


def special_tokens_processor(hf: HFTokenizer, bos_id: int | None, eos_id: int | None) -> processors.PostProcessor:
    """What `encode(add_special_tokens=True)` adds: BOS before and EOS after each sequence, either left out when
    None. Built as transformers' `update_post_processor` builds it when a tokenizer config says
    add_bos_token / add_eos_token, so the loaders can apply what a model's config says."""

    def special(token_id: int | None, type_id: int) -> list[str]:
        return [] if token_id is None else [f"{hf.id_to_token(token_id)}:{type_id}"]

    single = [*special(bos_id, 0), "$A:0", *special(eos_id, 0)]
    pair = [*single, *special(bos_id, 1), "$B:1", *special(eos_id, 1)]
    ids = [i for i in dict.fromkeys((bos_id, eos_id)) if i is not None]
    return processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=[(hf.id_to_token(i), i) for i in ids]
    )


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        name: str,
        eos_token_ids: set[int],
        bos_token_id: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.hf = tokenizer
        self.name = name
        self.eos_token_ids = set(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self._template = None if chat_template is None else compile_template(chat_template)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.hf.id_to_token(token_id) or "")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token strings in `text` (e.g. `<|im_start|>` from a chat template) become their ids.
        `add_special_tokens` adds what the model's tokenizer config says (BOS for Llama checkpoints; the
        loaders set it up as HF does): completions want it (vLLM's default), rendered chat templates do not,
        because the template already wrote BOS."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def added_tokens(self) -> dict[int, str]:
        """The added tokens (special ones among them) by id, with their text."""
        return {i: token.content for i, token in self.hf.get_added_tokens_decoder().items()}

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **variables: Any,
    ) -> str:
        """The conversation as the model's template (or a request's own `chat_template`) writes it. `variables`
        are more names the template may read (vLLM's chat_template_kwargs, `documents`, `reasoning_effort`);
        the conversation and the special tokens always win over them. `continue_final_message`: see
        `continue_final`. `tools` (OpenAI's), tool messages and assistant tool calls: as transformers passes
        them, or engine/model/tool_template.py's fallback where the template never reads `tools`."""
        template = self._template if chat_template is None else compile_template(chat_template)
        if template is None:
            raise ValueError(f"model {self.name!r} has no chat template; use the completions API")
        messages, tools = with_tools(messages, tools, self.chat_template if chat_template is None else chat_template)
        if tools is not None:
            variables = {**variables, "tools": tools}
        eos = min(self.eos_token_ids) if self.eos_token_ids else None
        _render.left = RENDER_BUDGET
        rendered = template.render(
            {
                **variables,
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "bos_token": self.token_text(self.bos_token_id),
                "eos_token": self.token_text(eos),
            }
        )
        return continue_final(rendered, messages[-1]["content"]) if continue_final_message else rendered


CONTEXT_TOKENS = 5  # prompt ids a detokenizer decodes its first token after


class IncrementalDetokenizer:
    """Text deltas for a stream of token ids. Decodes a short window of recent ids so the cost per token
    is constant, and holds back a delta that ends in an incomplete UTF-8 sequence (decoded as U+FFFD)
    until the next token completes it.

    `skip_special_tokens` leaves special tokens out of the text. Written out, with `spaces_between_special_tokens`
    False a special token right after another is its own text, without a space a decoder (WordPiece's, say)
    puts before it: vLLM's fast detokenizer does the same."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        context: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The last ids before the first new one (the prompt's), decoded with it: a SentencePiece decoder strips
        # the space that starts a text, so "▁Paris" alone is "Paris" but after "▁is" it is " Paris". Left out
        # where they end inside a character.
        seed = list(context[-CONTEXT_TOKENS:])
        if tokenizer.decode(seed, skip_special_tokens).endswith("\ufffd"):
            seed = []
        self.ids: list[int] = seed
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = len(seed)  # ids before this are already emitted as text
        self.text = ""
        joined = not (skip_special_tokens or spaces_between_special_tokens)
        self._added = tokenizer.added_tokens() if joined else {}  # empty: nothing to join
        self._after_added = False

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        delta = self._emit(final=False)
        if self._added:
            text = self._added.get(token_id)
            if text is not None and self._after_added and delta:
                self.text = self.text[: len(self.text) - len(delta)] + text
                delta = text
            self._after_added = text is not None
        return delta

    def flush(self) -> str:
        """The stream ended: the text of ids held back for an incomplete UTF-8 sequence (U+FFFD for it), as
        decoding the whole output would give."""
        return self._emit(final=True) if self.read_offset < len(self.ids) else ""

    def _emit(self, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
