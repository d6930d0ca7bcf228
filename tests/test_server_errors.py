"""Bad input gets a 4xx in OpenAI's error shape, and the server keeps serving; overload is a 429, a missing
API key a 401, and a dead engine loop a 503 on /health (never a 500, never a hang, never a lost request)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import torch

from engine.baselines.seed import FixedPolicy
from engine.core.llm_engine import LLMEngine
from engine.model.standin_tokenizer import StandInTokenizer
from engine.serving.app import create_app
from engine.serving.async_engine import AsyncEngine
from engine.serving.context import AppContext
from tests.fake_backend import FakeBackend
from tests.inproc_server import serve_in_thread

ERROR_KEYS = {"message", "type", "param", "code"}


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


COMPLETION = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
BAD = [  # (path, body, param, code)
    (COMPLETION, {"prompt": "hi", "max_tokens": 0}, "max_tokens", None),
    (COMPLETION, {"prompt": "hi", "max_tokens": -5}, "max_tokens", None),
    (COMPLETION, {"prompt": "hi", "temperature": -1}, "temperature", None),
    (COMPLETION, {"prompt": "hi", "top_p": 0}, "top_p", None),
    (COMPLETION, {"prompt": "hi", "top_k": -3}, "top_k", None),
    (COMPLETION, {"prompt": [1] * 9000, "max_tokens": 1}, "prompt", "context_length_exceeded"),
    (COMPLETION, {"prompt": "hi", "max_tokens": 100_000}, "max_tokens", "context_length_exceeded"),
    (COMPLETION, {"prompt": "hi", "n": 0}, "n", None),
    (COMPLETION, {"prompt": "hi", "n": 129}, "n", None),
    (COMPLETION, {"prompt": "hi", "suffix": "!"}, "suffix", "unsupported_field"),
    (COMPLETION, {"prompt": "hi", "logprobs": 21}, "logprobs", None),
    (COMPLETION, {"prompt": "hi", "logprobs": True}, "logprobs", None),
    (COMPLETION, {"prompt": "hi", "stop": ""}, "stop", None),
    (COMPLETION, {"prompt": "hi", "min_tokens": 20, "max_tokens": 4}, "min_tokens", None),
    (COMPLETION, {"prompt": []}, "prompt", None),
    (COMPLETION, {"prompt": [[]]}, "prompt", None),
    (COMPLETION, {"prompt": [[False]]}, "prompt", None),
    (COMPLETION, {"prompt": [1.5]}, "prompt", None),
    (COMPLETION, {"prompt": ["a", 1]}, "prompt", None),
    (COMPLETION, {"prompt": 7}, "prompt", None),
    (COMPLETION, {"prompt": [1, -2]}, "prompt", "invalid_token_id"),
    (COMPLETION, {"prompt": [10**9]}, "prompt", "invalid_token_id"),
    (COMPLETION, {"max_tokens": 4}, "prompt", None),
    (COMPLETION, {"prompt": "hi", "max_tokens": "many"}, "max_tokens", None),
    (CHAT, {"messages": []}, "messages", None),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages", None),
    (CHAT, {"messages": [{"role": "user"}]}, "messages", None),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", None),
    (CHAT, {"messages": USER, "n": 0}, "n", None),
    (CHAT, {"messages": USER, "temperature": "0.5"}, "temperature", None),
]


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:  # noqa: ANN001
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.mark.parametrize(("path", "body", "param", "code"), BAD)
def test_bad_parameters_are_400(http: httpx.Client, path: str, body: dict, param: str, code: str | None) -> None:
    err = assert_error(http.post(path, json=body), 400, param, code)
    assert err["type"] == "invalid_request_error"


def test_malformed_requests_are_400_404_405(http: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    assert_error(http.post(COMPLETION, content=b'{"prompt": "hi", ', headers=headers), 400)
    assert_error(http.post(COMPLETION, content=b"[1, 2]", headers=headers), 400)
    assert_error(http.post(COMPLETION, content=b"", headers=headers), 400)
    assert_error(http.get("/v1/no/such/route"), 404, code="not_found")
    assert_error(http.post("/v1/models"), 405, code="method_not_allowed")
    assert_error(http.patch("/controller/config", content=b"not json", headers=headers), 400)


def test_openai_client_sees_typed_errors_and_the_server_keeps_serving(client, model_name, http) -> None:  # noqa: ANN001
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    r = client.completions.create(model=model_name, prompt="hi", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1
    assert http.get("/health").status_code == 200


# ---- the twin server: API key and the waiting-queue bound --------------------------------------------


@pytest.fixture(scope="module")
def guarded(twin_server):  # noqa: ANN001, ANN201
    """One request at a time (fixed policy, one sequence), at most one waiting, and an API key."""
    return twin_server("--api-key", "sesame", "--policy", "fixed", "--max-num-seqs", "1", "--max-waiting", "1")


def test_api_key_is_required_on_v1(guarded) -> None:  # noqa: ANN001
    url = guarded.url
    assert_error(httpx.get(url + "/v1/models", timeout=30), 401, code="invalid_api_key")
    wrong = {"Authorization": "Bearer open"}
    assert_error(httpx.get(url + "/v1/models", headers=wrong, timeout=30), 401)
    ok = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sesame"}, timeout=30)
    assert ok.status_code == 200 and ok.json()["data"]
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # like vLLM: only /v1 is guarded


def test_full_waiting_queue_is_429_with_retry_after(guarded) -> None:  # noqa: ANN001
    headers = {"Authorization": "Bearer sesame"}
    long = {"prompt": "a long one", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=guarded.url, headers=headers, timeout=60) as h:
        with h.stream("POST", COMPLETION, json=long) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # keep the iterator: dropping it closes the connection
            assert next(lines).startswith("data:")  # it runs (the only sequence allowed)
            with h.stream("POST", COMPLETION, json=long) as waiting:
                assert waiting.status_code == 200  # accepted: it waits behind the running one
                r = h.post(COMPLETION, json={"prompt": "one more", "max_tokens": 2})
                assert_error(r, 429, code="queue_full")
                assert int(r.headers["retry-after"]) >= 1
        # both streams closed: they are aborted, and the server serves again
        deadline = time.monotonic() + 30
        while (r := h.post(COMPLETION, json={"prompt": "after", "max_tokens": 2})).status_code == 429:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# ---- in-process: a dying engine loop, an unrecovered OOM ---------------------------------------------

POISON = 666  # a step holding a prompt that starts with this token fails


class FailingBackend(FakeBackend):
    def __init__(self, failure: type[BaseException]) -> None:
        super().__init__(num_blocks=64, block_size=4, max_model_len=256)
        self.failure = failure

    def execute(self, batch):  # noqa: ANN001, ANN201
        if any(item.prompt_ids[0] == POISON for item in batch.items):
            raise self.failure("boom")
        time.sleep(0.02)  # slow enough that a second request arrives while the first streams
        return super().execute(batch)


@contextmanager
def serve_failing(failure: type[BaseException]) -> Iterator[tuple[str, AsyncEngine]]:
    server = AsyncEngine(LLMEngine(FailingBackend(failure), FixedPolicy()), max_waiting=8)
    app = create_app(AppContext(server, model_name="fake", tokenizer=StandInTokenizer(), vocab_size=1000))
    with serve_in_thread(app) as url:
        yield url, server


@pytest.mark.parametrize("failure", [RuntimeError, torch.OutOfMemoryError])
def test_engine_failure_answers_503_and_health_turns_503(failure: type[BaseException]) -> None:
    """A RuntimeError from a step kills the loop; an OOM under the fixed policy (no recovery) leaves it
    running with the engine unhealthy. Either way every open request gets an answer (the stream an error
    event, the other a 503), later requests a 503, and /health a 503."""
    with serve_failing(failure) as (url, server), httpx.Client(base_url=url, timeout=60) as h:
        ok = h.post(COMPLETION, json={"prompt": [1, 2, 3], "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert h.get("/health").status_code == 200
        body = {"prompt": [1, 2], "max_tokens": 200, "stream": True}
        with h.stream("POST", COMPLETION, json=body) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            assert next(lines).startswith("data:")
            assert_error(h.post(COMPLETION, json={"prompt": [POISON, 1], "max_tokens": 3}), 503)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]  # the stream ends with an error event
        assert_error(h.get("/health"), 503, code="engine_dead")
        assert_error(h.post(COMPLETION, json={"prompt": [1], "max_tokens": 1}), 503, code="engine_dead")
        if failure is RuntimeError:
            assert server.error is not None
        else:
            assert server.error is None and not server.engine.healthy
