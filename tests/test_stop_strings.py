"""Stop handling as vLLM does it: the checks' order, stop strings cut even on the last allowed token, and
found incrementally (the tokens decoded grow linearly with the output, not quadratically)."""

from __future__ import annotations

import random

import pytest

from controller.baselines import FixedPolicy
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.core.stop_strings import StopStringMatcher
from engine.model.loaders.hf import read_tokenizer
from tests.fake_backend import FakeBackend
from tests.fixtures_llama import CORPUS, build_tiny_llama

PROMPT = [5, 9, 14, 3, 7]


class LetterTokenizer:
    """Token t decodes to one letter; counts every token it is asked to decode."""

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return "".join(chr(ord("a") + t % 26) for t in ids)


def engine_with_text() -> tuple[LLMEngine, LetterTokenizer]:
    backend = FakeBackend(num_blocks=128, eos=-1)  # the fake's tokens are >= 1: no EOS
    backend.tokenizer = LetterTokenizer()
    return LLMEngine(backend, FixedPolicy(kv_reserve_ratio=0.0, max_num_seqs=64)), backend.tokenizer


def run(engine: LLMEngine, params: SamplingParams, request_id: str = "r"):
    seq = engine.add_request(request_id, PROMPT, params)
    while engine.has_unfinished():
        engine.step()
    return seq


def test_stop_string_completed_by_the_last_allowed_token_is_cut_and_reports_stop() -> None:
    engine, tok = engine_with_text()
    free = run(engine, SamplingParams(max_tokens=12), "free")
    text = tok.decode(free.output_ids)
    assert free.finish_reason == "length" and free.stop_text_len is None
    # the shortest suffix seen nowhere earlier: completed by exactly the 12th token
    stop = next(text[-k:] for k in range(1, len(text) + 1) if text.find(text[-k:]) == len(text) - k)
    seq = run(engine, SamplingParams(max_tokens=12, stop=["never", stop]), "stopped")
    assert seq.output_ids == free.output_ids
    assert seq.finish_reason == "stop"
    assert seq.stop_text_len == len(text) - len(stop)


def test_earliest_stop_string_cuts_even_when_found_in_the_same_step() -> None:
    engine, tok = engine_with_text()
    text = tok.decode(run(engine, SamplingParams(max_tokens=12), "free").output_ids)
    seq = run(engine, SamplingParams(max_tokens=12, stop=[text[4:7], text[2:6]]), "two")
    assert seq.finish_reason == "stop" and seq.stop_text_len == text.find(text[2:6])


def test_eos_before_min_tokens_is_ignored_and_min_tokens_bounded_by_the_context() -> None:
    engine, tok = engine_with_text()
    out = run(engine, SamplingParams(max_tokens=8), "free").output_ids
    seq = run(engine, SamplingParams(max_tokens=8, stop_token_ids=[out[1]], min_tokens=3), "min")
    assert seq.finish_reason == ("stop" if out[1] in seq.output_ids[2:] else "length")
    assert len(seq.output_ids) >= 3
    from engine.core.llm_engine import RequestError

    with pytest.raises(RequestError) as e:
        engine.add_request("too-many", PROMPT, SamplingParams(max_tokens=None, min_tokens=600))
    assert e.value.param == "min_tokens"


def decoded_tokens_for(max_tokens: int) -> int:
    engine, tok = engine_with_text()
    seq = run(engine, SamplingParams(max_tokens=max_tokens, stop=["no such text", "#"]))
    assert len(seq.output_ids) == max_tokens and seq.finish_reason == "length"
    return tok.decoded


def test_stop_strings_never_redecode_the_whole_output() -> None:
    short, long = decoded_tokens_for(200), decoded_tokens_for(400)
    # the old check decoded every output token every step: 400 * 401 / 2 = 80,200 tokens
    assert long <= 8 * 400
    assert long / short < 2.2  # linear, not quadratic (which would be ~4)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return read_tokenizer(build_tiny_llama(tmp_path_factory.mktemp("tiny")).hf_dir)


def brute_force(tokenizer, ids: list[int], stop: list[str]) -> tuple[int, int] | None:
    """(tokens when a stop string first appears, where the earliest one begins) by decoding every prefix."""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        hits = [i for s in stop if (i := text.find(s)) >= 0]
        if hits:
            return n, min(hits)
    return None


def test_matcher_agrees_with_decoding_every_prefix(tokenizer) -> None:
    """Real byte-level BPE (multi-byte characters split over tokens), stop strings taken from the text."""
    rng = random.Random(0)
    for case in range(40):
        text = " ".join(rng.sample(CORPUS[:4], 4))
        ids = tokenizer.encode(text)
        stop = [text[a : a + rng.randint(1, 6)] for a in rng.sample(range(len(text) - 6), 2)] + ["zzz"]
        matcher = StopStringMatcher(tokenizer, stop)
        found = next(((n, cut) for n in range(1, len(ids) + 1) if (cut := matcher.update(ids[:n])) is not None), None)
        assert found == brute_force(tokenizer, ids, stop), (case, stop)
