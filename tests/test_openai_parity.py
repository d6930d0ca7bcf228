"""OpenAI/vLLM parity of the HTTP API, against an in-process server over a model-free backend whose outputs
and logprobs are known, so every number in an answer can be checked: served model names, batched prompts,
n > 1 (indices, seeds, usage, aborting siblings), logprobs in both shapes, penalties, chat roles and content
parts, unsupported fields, bounded error bodies and the OpenAPI schema."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from engine.baselines.seed import FixedPolicy
from engine.core.batch import ModelOutput, ScheduledItem
from engine.core.llm_engine import LLMEngine
from engine.core.sequence import TokenLogprob
from engine.core.stats import FinishedRequest
from engine.model.standin_tokenizer import FILLER, StandInTokenizer
from engine.serving.app import create_app
from engine.serving.async_engine import AsyncEngine
from engine.serving.context import AppContext
from tests.fake_backend import FakeBackend
from tests.inproc_server import serve_in_thread
from tests.test_server_errors import assert_error

VOCAB = 1000
COMPLETION, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def chosen_logprob(token: int) -> float:
    return -token / 1000


class LogprobBackend(FakeBackend):
    """FakeBackend whose sampled tokens come with logprobs: the chosen token's is -token/1000, and the top k
    are (token, that) then (token + i, that - i). Each step sleeps a little, so streams interleave and a
    client can leave mid-way."""

    def execute(self, batch):  # noqa: ANN001, ANN201
        out = super().execute(batch)
        logprobs = []
        for item, token in zip([it for it in batch.items if it.sample], out.sampled, strict=True):
            k, lp = item.params.logprobs, chosen_logprob(token)
            logprobs.append(None if k is None else TokenLogprob(lp, [(token + i, lp - i) for i in range(k)]))
        time.sleep(0.005)
        return ModelOutput(out.sampled, logprobs)


@dataclass
class Served:
    url: str
    engine: AsyncEngine
    backend: LogprobBackend
    finished: list[FinishedRequest] = field(default_factory=list)

    def seqs(self) -> dict[str, FinishedRequest]:
        """Every finished request, by request id (finished before its answer is sent)."""
        return {s.request_id: s for s in self.finished}

    def received(self, request_id: str) -> ScheduledItem:
        """The request as the backend first received it: its prompt and sampling parameters."""
        return next(it for batch in self.backend.steps for it in batch.items if it.request_id == request_id)

    def wait_idle(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.engine.num_running() or self.engine.num_waiting() or self.engine.snapshot.stats.kv_blocks_used:
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    backend = LogprobBackend(num_blocks=256, block_size=4, max_model_len=512)
    engine = AsyncEngine(LLMEngine(backend, FixedPolicy()), max_waiting=64)
    state = Served("", engine, backend)
    engine.on_finish.append(state.finished.append)
    ctx = AppContext(
        engine, model_name="fake", tokenizer=StandInTokenizer(), vocab_size=VOCAB, other_names=("default",)
    )
    with serve_in_thread(create_app(ctx)) as url:
        state.url = url
        yield state


@pytest.fixture
def http(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=60) as client:
        yield client


def sse(r: httpx.Response) -> list[dict]:
    """The JSON events of a stream, checking it ends with [DONE]."""
    data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


# ---- model names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [COMPLETION, CHAT])
def test_an_answer_carries_the_served_name_the_client_asked_for(http: httpx.Client, path: str) -> None:
    """As vLLM: any of the served names, echoed in the body and in every streamed chunk."""
    ids = [card["id"] for card in http.get("/v1/models").json()["data"]]
    assert ids == ["fake", "default"]
    body = {"model": "default", "prompt": "hi", "messages": USER, "max_tokens": 2}
    r = http.post(path, json=body)
    assert r.status_code == 200 and r.json()["model"] == "default"
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert {e["model"] for e in sse(r)} == {"default"}
    assert http.post(path, json={**body, "model": None}).json()["model"] == "fake"  # none asked: the first


@pytest.mark.parametrize("path", [COMPLETION, CHAT])
def test_an_unknown_model_is_404_model_not_found(http: httpx.Client, path: str) -> None:
    body = {"model": "gpt-4o", "prompt": "hi", "messages": USER}
    assert_error(http.post(path, json=body), 404, "model", "model_not_found")


# ---- prompts, n, seeds, usage --------------------------------------------------------------------------


def test_a_list_of_prompts_times_n_gives_prompt_major_choices(served: Served, http: httpx.Client) -> None:
    prompts = ["abcdefgh", "abcd"]  # 2 and 1 stand-in tokens
    body = {"prompt": prompts, "n": 3, "max_tokens": 5, "seed": 40, "ignore_eos": True}
    before = set(served.seqs())
    r = http.post(COMPLETION, json=body).json()
    assert [c["index"] for c in r["choices"]] == list(range(6))
    assert all(c["text"] == FILLER * 5 and c["finish_reason"] == "length" for c in r["choices"])
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 30, "total_tokens": 33}
    new = [served.received(rid) for rid in served.seqs() if rid not in before]
    by_prompt = {2: sorted(s.params.seed for s in new if len(s.prompt_ids) == 2)}
    by_prompt[1] = sorted(s.params.seed for s in new if len(s.prompt_ids) == 1)
    assert by_prompt == {2: [40, 41, 42], 1: [40, 41, 42]}  # sample j uses seed + j, per prompt


def test_token_id_prompts_single_and_batched(served: Served, http: httpx.Client) -> None:
    one = http.post(COMPLETION, json={"prompt": [5, 6, 7], "max_tokens": 2}).json()
    assert one["usage"]["prompt_tokens"] == 3 and len(one["choices"]) == 1
    two = http.post(COMPLETION, json={"prompt": [[5, 6, 7], [VOCAB - 1]], "max_tokens": 2}).json()
    assert two["usage"]["prompt_tokens"] == 4 and [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][0]["text"] == one["choices"][0]["text"]
    assert_error(http.post(COMPLETION, json={"prompt": [[5], [VOCAB]]}), 400, "prompt", "invalid_token_id")


def test_streaming_n_carries_each_choice_index_and_sums_usage(http: httpx.Client) -> None:
    body = {"prompt": ["abcd", "abcdefgh"], "n": 2, "max_tokens": 4, "ignore_eos": True}
    full = http.post(COMPLETION, json=body).json()
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", COMPLETION, json=stream) as r:
        events = sse(r)
    texts: dict[int, str] = {}
    finished = {}
    for e in events[:-1]:
        (choice,) = e["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finished[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in full["choices"]}
    assert finished == dict.fromkeys(range(4), "length")
    assert events[-1]["choices"] == [] and events[-1]["usage"] == full["usage"]
    assert full["usage"] == {"prompt_tokens": 3, "completion_tokens": 16, "total_tokens": 19}


def test_chat_n_streams_a_role_chunk_and_a_finish_per_choice(http: httpx.Client) -> None:
    with http.stream("POST", CHAT, json={"messages": USER, "n": 3, "max_tokens": 3, "stream": True}) as r:
        events = sse(r)
    roles = [e["choices"][0]["index"] for e in events if e["choices"][0]["delta"].get("role") == "assistant"]
    ends = [e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]]
    assert sorted(roles) == sorted(ends) == [0, 1, 2]


def test_a_client_leaving_a_stream_aborts_every_sibling(served: Served, http: httpx.Client) -> None:
    served.wait_idle()
    aborted = sum(s.finish_reason == "abort" for s in served.finished)
    body = {"prompt": "abcd", "n": 3, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", COMPLETION, json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")  # leaving the block closes the connection mid-stream
    served.wait_idle()
    assert sum(s.finish_reason == "abort" for s in served.finished) == aborted + 3


def test_a_client_leaving_a_non_streaming_answer_aborts_every_sibling(served: Served) -> None:
    served.wait_idle()
    aborted = sum(s.finish_reason == "abort" for s in served.finished)
    body = {"prompt": "abcd", "n": 2, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + COMPLETION, json=body, timeout=httpx.Timeout(30, read=0.5))
    served.wait_idle()
    assert sum(s.finish_reason == "abort" for s in served.finished) == aborted + 2


def test_a_refused_sibling_aborts_those_accepted(served: Served, http: httpx.Client) -> None:
    """n beyond the waiting queue's room: a 429, and no sibling is left running."""
    served.wait_idle()
    r = http.post(COMPLETION, json={"prompt": "abcd", "n": 100, "max_tokens": 200, "ignore_eos": True})
    assert_error(r, 429, code="queue_full")
    served.wait_idle()


# ---- logprobs and penalties ----------------------------------------------------------------------------


def test_completion_logprobs_legacy_object_streamed_and_not(http: httpx.Client) -> None:
    body = {"prompt": "abcd", "max_tokens": 5, "logprobs": 2, "ignore_eos": True}
    full = http.post(COMPLETION, json=body).json()["choices"][0]
    lp = full["logprobs"]
    assert lp["tokens"] == [FILLER] * 5 and lp["text_offset"] == [0, 4, 8, 12, 16]
    assert all(v < 0 for v in lp["token_logprobs"])
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top == {FILLER: chosen}  # every stand-in token decodes to the filler: one key
    with http.stream("POST", COMPLETION, json={**body, "stream": True}) as r:
        pieces = [e["choices"][0]["logprobs"] for e in sse(r) if e["choices"][0]["logprobs"]]
    joined = {k: [v for p in pieces for v in p[k]] for k in lp}
    assert joined == lp


def test_completion_logprobs_are_the_engine_s(served: Served, http: httpx.Client) -> None:
    before = set(served.seqs())
    r = http.post(COMPLETION, json={"prompt": [9, 8], "max_tokens": 3, "logprobs": 0, "ignore_eos": True})
    (seq,) = [s for rid, s in served.seqs().items() if rid not in before]
    assert r.json()["choices"][0]["logprobs"]["token_logprobs"] == [chosen_logprob(t) for t in seq.output_ids]
    assert served.received(seq.request_id).params.logprobs == 0


def test_chat_logprobs_content_with_top_logprobs(http: httpx.Client) -> None:
    body = {"messages": USER, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    choice = http.post(CHAT, json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert entry["token"] == FILLER and entry["bytes"] == list(FILLER.encode())
        assert [t["logprob"] for t in entry["top_logprobs"]] == [entry["logprob"], entry["logprob"] - 1]
    with http.stream("POST", CHAT, json={**body, "stream": True}) as r:
        streamed = [x for e in sse(r) if (lp := e["choices"][0]["logprobs"]) for x in lp["content"]]
    assert streamed == content
    plain = http.post(CHAT, json={"messages": USER, "max_tokens": 2}).json()["choices"][0]
    assert plain["logprobs"] is None


def test_chat_top_logprobs_needs_logprobs(http: httpx.Client) -> None:
    assert_error(http.post(CHAT, json={"messages": USER, "top_logprobs": 2}), 400, "top_logprobs")
    assert_error(http.post(CHAT, json={"messages": USER, "logprobs": True, "top_logprobs": 21}), 400, "top_logprobs")


def test_penalties_reach_the_engine(served: Served, http: httpx.Client) -> None:
    before = set(served.seqs())
    body = {"prompt": "abcd", "max_tokens": 2, "presence_penalty": 0.5, "frequency_penalty": -0.25}
    assert http.post(COMPLETION, json={**body, "repetition_penalty": 1.3}).status_code == 200
    (rid,) = [rid for rid in served.seqs() if rid not in before]
    params = served.received(rid).params
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.5,
        -0.25,
        1.3,
    )


# ---- chat messages -------------------------------------------------------------------------------------


def test_developer_is_rendered_as_system_and_text_parts_are_joined(served: Served, http: httpx.Client) -> None:
    tok = StandInTokenizer()
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
    ]
    before = set(served.seqs())
    assert http.post(CHAT, json={"messages": messages, "max_tokens": 1}).status_code == 200
    (rid,) = [rid for rid in served.seqs() if rid not in before]
    expected = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert list(served.received(rid).prompt_ids) == tok.encode(tok.apply_chat_template(expected))


def test_tool_messages_reach_the_template(http: httpx.Client) -> None:
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    assert http.post(CHAT, json={"messages": messages, "max_tokens": 1}).status_code == 200


BAD_MESSAGES = [
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
    [{"role": "tool", "content": "42"}],  # no tool_call_id
    [{"role": "assistant", "content": None}],  # neither content nor tool calls
    [{"role": "user", "content": [{"type": "text"}]}],
]


@pytest.mark.parametrize("messages", BAD_MESSAGES)
def test_bad_messages_are_400_naming_messages(http: httpx.Client, messages: list) -> None:
    assert_error(http.post(CHAT, json={"messages": messages}), 400, "messages")


# ---- fields we do not implement ------------------------------------------------------------------------

UNSUPPORTED = [
    (COMPLETION, "suffix", "!"),
    (COMPLETION, "best_of", 3),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "web_search_options", {}),
]


@pytest.mark.parametrize(("path", "name", "value"), UNSUPPORTED)
def test_fields_that_would_change_the_answer_are_400_naming_them(
    http: httpx.Client, path: str, name: str, value: object
) -> None:
    body = {"prompt": "hi", "messages": USER, "max_tokens": 1, name: value}
    assert name in assert_error(http.post(path, json=body), 400, name)["message"]


HARMLESS = {
    "user": "me",
    "metadata": {"k": "v"},
    "store": False,
    "tools": [],
    "tool_choice": "none",
    "response_format": {"type": "text"},
    "logit_bias": {},
    "best_of": 1,
    "echo": False,
}


@pytest.mark.parametrize("path", [COMPLETION, CHAT])
def test_harmless_fields_are_ignored(http: httpx.Client, path: str) -> None:
    r = http.post(path, json={"prompt": "hi", "messages": USER, "max_tokens": 1, **HARMLESS})
    assert r.status_code == 200, r.text


# ---- errors stay small ---------------------------------------------------------------------------------

HUGE = "x" * 10_000_000


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hi", "model": HUGE},
        {"prompt": "hi", "temperature": HUGE},
        {"prompt": "hi", "suffix": HUGE},
        {"prompt": "hi", "stop": [HUGE, ""]},
        {"messages": [{"role": HUGE, "content": "hi"}]},
        {"messages": [{"role": "user", "content": [{"type": HUGE}]}]},
        {"prompt": "hi", HUGE: 1, "n": 0},
    ],
)
def test_a_10mb_value_gets_a_small_error(http: httpx.Client, body: dict) -> None:
    path = CHAT if "messages" in body else COMPLETION
    r = http.post(path, json=body)
    assert 400 <= r.status_code < 500 and len(r.content) < 2000, (r.status_code, len(r.content))
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_10mb_controller_config_key_gets_a_small_error(http: httpx.Client) -> None:
    r = http.patch("/controller/config", json={HUGE: 1})
    assert r.status_code == 400 and len(r.content) < 2000


# ---- the OpenAPI schema says what the server answers ---------------------------------------------------


def test_openapi_lists_400_not_422_and_the_real_content_types(http: httpx.Client) -> None:
    schema = http.get("/openapi.json").json()
    assert "422" not in json.dumps(schema) and "HTTPValidationError" not in schema["components"]["schemas"]
    paths = schema["paths"]
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for route in (COMPLETION, CHAT):
        responses = paths[route]["post"]["responses"]
        for status in ("400", "401", "404", "429", "503", "500"):
            assert responses[status]["content"]["application/json"]["schema"] == error_ref, (route, status)
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(paths["/v1/models"]["get"]["responses"]) >= {"200", "401"}
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(paths["/controller/config"]["patch"]["responses"]) >= {"200", "400", "401"}
    assert "400" in paths["/controller/state"]["get"]["responses"]  # its `steps` query is validated
    assert set(paths["/health"]["get"]["responses"]) >= {"200", "503"}
    assert http.get("/controller/state", params={"steps": "many"}).status_code == 400
    assert_error(http.get("/metrics"), 404)  # this server runs without metrics: the documented 404
    assert "404" in paths["/metrics"]["get"]["responses"]
    assert schema["components"]["schemas"]["ErrorResponse"]["properties"]["error"] == {
        "$ref": "#/components/schemas/ErrorDetail"
    }


# ---- `headroom serve` on the twin: names and vocabulary from the command line and the profile -----------


def test_twin_serves_its_model_and_the_model_flag_and_checks_its_vocabulary(twin_server) -> None:  # noqa: ANN001
    url = twin_server().url
    ids = [card["id"] for card in httpx.get(url + "/v1/models", timeout=30).json()["data"]]
    assert ids == ["meta-llama/Llama-3.1-8B-Instruct", "default"]
    ok = httpx.post(url + COMPLETION, json={"model": "default", "prompt": [128255], "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200 and ok.json()["model"] == "default"
    for prompt in ([128256], [10**9], [[1], [128256]]):
        r = httpx.post(url + COMPLETION, json={"prompt": prompt, "max_tokens": 1}, timeout=60)
        assert_error(r, 400, "prompt", "invalid_token_id")


def test_served_model_names_replace_the_defaults(twin_server) -> None:  # noqa: ANN001
    url = twin_server("--served-model-name", "first", "second").url
    ids = [card["id"] for card in httpx.get(url + "/v1/models", timeout=30).json()["data"]]
    assert ids == ["first", "second"]
    r = httpx.post(url + CHAT, json={"model": "second", "messages": USER, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "second"
    assert_error(httpx.post(url + CHAT, json={"model": "default", "messages": USER}, timeout=60), 404, "model")
