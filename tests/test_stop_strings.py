"""Stop handling as vLLM does it: the core decides on tokens (EOS, stop token ids, min_tokens, length), the
front end's output processor on text (stop strings cut before themselves, or after with
include_stop_str_in_output, even on the last allowed token; none searched before min_tokens), decoding each
token once; a stream never sends text a stop string later cuts, and its deltas add up to the final text."""

from __future__ import annotations

import random

import pytest

from engine.baselines.seed import FixedPolicy
from engine.core.llm_engine import LLMEngine, RequestError
from engine.core.outputs import EngineOutput
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import TokenLogprob
from engine.frontend.output_processor import OutputProcessor, RequestOutput
from engine.llm import LLM, CompletionOutput
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


class CharTokenizer:
    """One token per character (ids are code points), so stop strings straddle tokens arbitrarily."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def llm_with_text() -> tuple[LLM, LetterTokenizer]:
    backend = FakeBackend(num_blocks=128, eos=-1)  # the fake's tokens are >= 1: no EOS
    backend.tokenizer = LetterTokenizer()
    return LLM(engine=LLMEngine(backend, FixedPolicy(kv_reserve_ratio=0.0, max_num_seqs=64))), backend.tokenizer


def run(llm: LLM, params: SamplingParams) -> CompletionOutput:
    out = llm.generate([PROMPT], params)[0]
    assert llm.engine.allocator.num_used == 0 and not llm.engine.requests
    return out


def feed(processor: OutputProcessor, request_id: str, ids: list[int], final: str | None = None) -> list[RequestOutput]:
    """One token per step, as the core emits them; `final` is the core's reason on the last token."""
    outs = []
    for n, t in enumerate(ids, 1):
        reason = final if n == len(ids) else None
        outs += processor.process([EngineOutput(request_id, [t], [], reason)]).outputs
        if outs[-1].finish_reason is not None:
            break
    return outs


def test_stop_string_completed_by_the_last_allowed_token_is_cut_and_reports_stop() -> None:
    llm, _ = llm_with_text()
    free = run(llm, SamplingParams(max_tokens=12))
    text = free.text
    assert free.finish_reason == "length" and len(text) == 12
    # the shortest suffix seen nowhere earlier: completed by exactly the 12th token
    stop = next(text[-k:] for k in range(1, len(text) + 1) if text.find(text[-k:]) == len(text) - k)
    out = run(llm, SamplingParams(max_tokens=12, stop=["never", stop]))
    assert out.token_ids == free.token_ids
    assert (out.finish_reason, out.text) == ("stop", text[: len(text) - len(stop)])
    kept = run(llm, SamplingParams(max_tokens=12, stop=[stop], include_stop_str_in_output=True))
    assert (kept.finish_reason, kept.text) == ("stop", text)


def test_a_stop_string_ends_the_request_in_the_core_at_once() -> None:
    """The token that completes it is the last one computed: the core is told before its next step."""
    llm, _ = llm_with_text()
    text = run(llm, SamplingParams(max_tokens=12)).text
    stop = text[4:7]
    first = text.find(stop)
    finished = []
    llm.engine.finish_listeners.append(lambda seq: finished.append(seq.finish_reason))
    out = run(llm, SamplingParams(max_tokens=12, stop=[stop]))
    assert len(out.token_ids) == first + len(stop) and out.text == text[:first]
    assert out.finish_reason == "stop" and finished == ["stop"]  # the policy learns a stop, not an abort


def test_earliest_stop_string_cuts_even_when_found_in_the_same_step() -> None:
    llm, _ = llm_with_text()
    text = run(llm, SamplingParams(max_tokens=12)).text
    out = run(llm, SamplingParams(max_tokens=12, stop=[text[4:7], text[2:6]]))
    assert out.finish_reason == "stop" and out.text == text[: text.find(text[2:6])]


def test_stop_strings_are_not_searched_before_min_tokens() -> None:
    llm, _ = llm_with_text()
    text = run(llm, SamplingParams(max_tokens=40)).text
    stop, min_tokens = text[1:3], 6
    # searched from the min_tokens-th token on, over its text and the len(stop) - 1 characters before it
    ends = [i + len(stop) for i in range(len(text)) if text.startswith(stop, i) and i + len(stop) >= min_tokens]
    out = run(llm, SamplingParams(max_tokens=40, stop=[stop], min_tokens=min_tokens))
    if ends:
        assert out.finish_reason == "stop" and out.text == text[: ends[0] - len(stop)]
        assert len(out.token_ids) == ends[0]
    else:
        assert out.finish_reason == "length" and out.text == text
    assert stop in out.text  # the early occurrence stayed


def test_eos_before_min_tokens_is_ignored_and_min_tokens_bounded_by_the_context() -> None:
    llm, _ = llm_with_text()
    out = run(llm, SamplingParams(max_tokens=8)).token_ids
    seq = run(llm, SamplingParams(max_tokens=8, stop_token_ids=[out[1]], min_tokens=3))
    assert seq.finish_reason == ("stop" if out[1] in seq.token_ids[2:] else "length")
    assert len(seq.token_ids) >= 3
    with pytest.raises(RequestError) as e:
        llm.engine.add_request("too-many", PROMPT, SamplingParams(max_tokens=None, min_tokens=600))
    assert e.value.param == "min_tokens"


def decoded_tokens_for(max_tokens: int) -> int:
    llm, tok = llm_with_text()
    out = run(llm, SamplingParams(max_tokens=max_tokens, stop=["no such text", "#"]))
    assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
    return tok.decoded


def test_each_token_is_decoded_once_not_the_whole_output_every_step() -> None:
    short, long = decoded_tokens_for(200), decoded_tokens_for(400)
    assert long <= 4 * 400  # the detokenizer's window: a few tokens per token
    assert long / short < 2.2  # linear, not quadratic (which would be ~4)


@pytest.mark.parametrize("stop", ["lo w", "o", "xyz", "world!", "bye"])
def test_a_stream_never_sends_text_a_stop_string_cuts(stop: str) -> None:
    full = "hello world! bye"
    cut = full.find(stop)
    expected = full if cut < 0 else full[:cut]
    processor = OutputProcessor(CharTokenizer())
    processor.add_request("r", SamplingParams(stop=[stop]))
    sent = ""
    for out in feed(processor, "r", [ord(c) for c in full], final="length"):
        sent += out.text
        assert expected.startswith(sent), (sent, expected)
    assert sent == expected and len(processor) == 0


def test_logprob_entries_carry_the_token_texts() -> None:
    processor = OutputProcessor(CharTokenizer())
    processor.add_request("r", SamplingParams(logprobs=1))
    entry = TokenLogprob(-0.5, [(ord("x"), -0.25)])
    (out,) = processor.process([EngineOutput("r", [ord("a")], [entry], "length")]).outputs
    assert (out.text, out.token_ids, out.finish_reason) == ("a", [ord("a")], "length")
    assert [(e.token, e.logprob, e.top) for e in out.logprobs] == [("a", -0.5, [("x", -0.25)])]


def test_an_abort_is_the_request_s_last_message() -> None:
    processor = OutputProcessor(CharTokenizer())
    processor.add_request("r", SamplingParams(stop=["zz"]))
    (first,) = feed(processor, "r", [ord("z")])
    assert first.text == "" and first.finish_reason is None  # "z" may start "zz": held back
    assert processor.abort("r") == RequestOutput("r", "", [], finish_reason="abort")
    assert processor.abort("r") is None and not processor.process([EngineOutput("r", [1], [], None)]).outputs


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


def test_processor_agrees_with_decoding_every_prefix(tokenizer) -> None:
    """Real byte-level BPE (multi-byte characters split over tokens), stop strings taken from the text."""
    rng = random.Random(0)
    for case in range(40):
        text = " ".join(rng.sample(CORPUS[:4], 4))
        ids = tokenizer.encode(text)
        stop = [text[a : a + rng.randint(1, 6)] for a in rng.sample(range(len(text) - 6), 2)] + ["zzz"]
        processor = OutputProcessor(tokenizer)
        processor.add_request("r", SamplingParams(stop=stop))
        outs = feed(processor, "r", ids, final="length")
        streamed = "".join(o.text for o in outs)
        expected = brute_force(tokenizer, ids, stop)
        if expected is None:
            assert (outs[-1].finish_reason, streamed) == ("length", tokenizer.decode(ids)), case
        else:
            n, cut = expected
            assert (len(outs), outs[-1].finish_reason) == (n, "stop"), (case, stop)
            assert streamed == tokenizer.decode(ids[:n])[:cut], (case, stop)


def test_without_stop_strings_the_deltas_are_the_whole_decode(tokenizer) -> None:
    """UTF-8 safe: a character split over tokens is sent whole, once its last byte arrives."""
    text = CORPUS[2]
    ids = tokenizer.encode(text)
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", SamplingParams())
    outs = feed(processor, "r", ids, final="stop")
    assert all("\ufffd" not in o.text for o in outs)
    assert "".join(o.text for o in outs) == tokenizer.decode(ids) == text


def test_a_request_ending_inside_a_character_gets_what_decoding_its_output_gives(tokenizer) -> None:
    ids = tokenizer.encode("東京 🙂")
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", SamplingParams())
    outs = feed(processor, "r", ids[:cut], final="length")
    assert "".join(o.text for o in outs) == tokenizer.decode(ids[:cut])
