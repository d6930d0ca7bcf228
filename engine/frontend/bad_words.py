"""vLLM's bad words as token ids, which is what the sampler bans (engine/core/logits_controls.py).

Each word is tokenized as it would start the text and, where that is a different word token of the same
length, with a leading space, as it would follow another word: a byte-level BPE spells " word" with another
token than "word". vLLM's `SamplingParams.update_from_tokenizer` builds the same list.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.core.sampling_params import ParamError, SamplingParams


def bad_words_token_ids(words: list[str], tokenizer: Any) -> list[list[int]]:
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ParamError("bad_words", f"bad word {word!r} has no tokens")
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def with_bad_words_tokenized(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """`params` with its bad words tokenized, where it has words and no ids yet."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    return replace(params, bad_words_token_ids=bad_words_token_ids(params.bad_words, tokenizer))
