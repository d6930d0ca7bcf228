"""Tokenizer: a `tokenizers` BPE plus the model's jinja2 chat template, and a streaming detokenizer."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    """HF's override: jinja2's own tojson HTML-escapes, which changes the prompt."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


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
        self._template: jinja2.Template | None = None
        if chat_template is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = _tojson
            self._template = env.from_string(chat_template)

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

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError(f"model {self.name!r} has no chat template; use the completions API")
        eos = min(self.eos_token_ids) if self.eos_token_ids else None
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.token_text(self.bos_token_id),
            eos_token=self.token_text(eos),
        )


class IncrementalDetokenizer:
    """Text deltas for a stream of token ids. Decodes a short window of recent ids so the cost per token
    is constant, and holds back a delta that ends in an incomplete UTF-8 sequence (decoded as U+FFFD)
    until the next token completes it."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = 0  # ids before this are already emitted as text
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._emit(final=False)

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
