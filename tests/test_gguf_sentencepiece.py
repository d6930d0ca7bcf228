"""A SentencePiece BPE vocabulary in a GGUF (`tokenizer.ggml.model` llama: Llama 2, Mistral, Gemma and Phi-3
files), written as llama.cpp's converter writes one from a `tokenizer.model` (its pieces, scores and piece
types), encodes and decodes as the `sentencepiece` library that trained it does: merges by score, spaces as
`▁`, the dummy prefix, and a character outside the vocabulary as its UTF-8 byte tokens."""

from __future__ import annotations

import io
from pathlib import Path

import gguf
import pytest
import sentencepiece as spm

from engine.model.loaders.gguf import GGUFFile
from engine.model.tokenizer import IncrementalDetokenizer
from tests.fixtures_llama import CORPUS, write

TEXTS = [
    "The capital of France is Paris.",
    "Hello world!  How are you today?",
    "   leading spaces, and trailing ones   ",
    "Numbers like 12345 and 3.14159, ünïcödé, 東京 and 🙂.",
    "def main():\n    print('hello')\n\treturn 0\n",
    "words never seen: zyxwvut QQQ Ω≈ç√",
    "",
    " ",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[spm.SentencePieceProcessor, Path]:
    """A BPE model trained as Llama 2's was (identity normalization, spaces kept, byte fallback), and its GGUF."""
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=proto, vocab_size=400, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    w.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    w.add_token_types([piece_type(sp, i) for i in range(sp.get_piece_size())])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    write(w)
    return sp, path


def piece_type(sp: spm.SentencePieceProcessor, i: int) -> int:
    """The converter's `SentencePieceTokenTypes`: NORMAL 1, UNKNOWN 2, CONTROL 3, UNUSED 5, BYTE 6."""
    for kind, test in [(2, sp.is_unknown), (3, sp.is_control), (5, sp.is_unused), (6, sp.is_byte)]:
        if test(i):
            return kind
    return 1


@pytest.mark.parametrize("text", TEXTS)
def test_encodes_and_decodes_as_sentencepiece(trained: tuple[spm.SentencePieceProcessor, Path], text: str) -> None:
    sp, path = trained
    tok = GGUFFile(path).tokenizer("spm")
    ids = tok.encode(text)
    assert ids == sp.encode(text)
    assert tok.decode(ids) == sp.decode(ids) == text
    assert tok.encode(text, add_special_tokens=True) == [sp.bos_id(), *ids]  # llama.cpp's BOS, with no key


@pytest.mark.parametrize("text", [t for t in TEXTS if t.strip()])
def test_streamed_text_after_a_prompt_is_the_whole_texts_rest(
    trained: tuple[spm.SentencePieceProcessor, Path], text: str
) -> None:
    """Each word's `▁` is a space the decoder strips at the start of a text: the stream's first token, decoded
    after the prompt's last ones, keeps it, and the deltas join to what decoding prompt and output together
    gives past the prompt's text (a prompt that ends inside a character has no text of its own to be past)."""
    sp, path = trained
    tok = GGUFFile(path).tokenizer("spm")
    ids = tok.encode(text)
    for cut in [c for c in range(1, len(ids)) if not sp.decode(ids[:c]).endswith("\ufffd")]:
        detok = IncrementalDetokenizer(tok, context=ids[:cut])
        streamed = "".join(detok.add(i) for i in ids[cut:]) + detok.flush()
        assert streamed == text[len(sp.decode(ids[:cut])) :]
