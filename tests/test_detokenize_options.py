"""vLLM's detokenization options in the output processor: skip_special_tokens, and spaces_between_special_tokens
as vLLM's fast detokenizer has it (a special token right after another is its own text, without the space a
WordPiece decoder puts before it); offline bad words tokenized as vLLM does; HF's continue_final_message."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from engine.core.outputs import EngineOutput
from engine.core.sampling_params import ParamError, SamplingParams
from engine.frontend.bad_words import bad_words_token_ids, with_bad_words_tokenized
from engine.frontend.output_processor import OutputProcessor
from engine.model.tokenizer import Tokenizer, continue_final


@pytest.fixture(scope="module")
def wordpiece() -> Tokenizer:
    """A BERT-like tokenizer: its decoder joins tokens with spaces, special ones too."""
    hf = HFTokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.decoder = decoders.WordPiece()
    hf.add_special_tokens(["<a>", "<b>"])
    return Tokenizer(hf, name="wordpiece", eos_token_ids=set())


def text_of(tokenizer: Tokenizer, ids: list[int], **options: bool) -> tuple[str, list[str]]:
    """The text one request's output gets, token by token (the last output ends it), and its deltas."""
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", SamplingParams(**options))
    deltas = []
    for i, token in enumerate(ids):
        reason = "length" if i == len(ids) - 1 else None
        deltas += [out.text for out in processor.process([EngineOutput("r", [token], finish_reason=reason)]).outputs]
    return "".join(deltas), deltas


@pytest.mark.parametrize(
    ("options", "text"),
    [
        ({}, "hello worlds"),
        ({"skip_special_tokens": False}, "hello <a> <b> worlds"),
        ({"skip_special_tokens": False, "spaces_between_special_tokens": False}, "hello <a><b> worlds"),
        ({"spaces_between_special_tokens": False}, "hello worlds"),
    ],
)
def test_special_tokens_in_the_text(wordpiece: Tokenizer, options: dict, text: str) -> None:
    ids = wordpiece.encode("hello<a><b>worlds")
    assert ids == [1, 4, 5, 2, 3]
    assert text_of(wordpiece, ids, **options)[0] == text


def test_bad_words_are_tokenized_alone_and_after_a_space(tokenizer) -> None:  # noqa: ANN001
    """vLLM's: the word as the text would start, and " word" where that is another token of the same length."""
    ids = bad_words_token_ids(["Paris", " Lyon"], tokenizer)
    assert tokenizer.encode("Paris") in ids and tokenizer.encode(" Paris") in ids
    assert tokenizer.encode("Lyon") in ids
    params = with_bad_words_tokenized(SamplingParams(bad_words=["Paris"]), tokenizer)
    params.validate(tokenizer.vocab_size)
    assert params.bad_words_token_ids == bad_words_token_ids(["Paris"], tokenizer)
    with pytest.raises(ParamError):
        SamplingParams(bad_words=["Paris"]).validate()  # never silently unapplied


def test_continue_final_message_cuts_the_render_after_the_final_message() -> None:
    rendered = "<s>user: hi</s><s>assistant: The capital is </s>"
    assert continue_final(rendered, "The capital is ") == "<s>user: hi</s><s>assistant: The capital is "
    assert continue_final("<s>assistant: The capital is</s>", "The capital is  ") == "<s>assistant: The capital is"
    with pytest.raises(ValueError, match="does not appear"):
        continue_final(rendered, "Lyon")
