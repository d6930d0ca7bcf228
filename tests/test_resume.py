"""A stream cut short on one server goes on, token-exact, on another (engine/serving/ray_serve/resend.py sends the
`resume` this exercises): the second server prefills the prompt and the tokens the client got, and continues with
the same sampling. Its chunks carry on the text where the client's stopped (what the first held back, a possible
stop string or an unfinished character, still comes), without the chat stream's opening again, and its usage
counts every token the client got.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.serving.answer_bodies import RESUMABLE_HEADER
from tests.test_model_families import served
from tests.tiny_families import build

TOKENS = 24
PROMPT = [5 + (7 * j) % 300 for j in range(20)]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    family = build("llama", tmp_path_factory.mktemp("llama"))
    with served(family.hf_dir, "--served-model-name", "m") as url:
        yield url


def stream(url: str, path: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], httpx.Headers]:
    """The stream's JSON chunks, in order, and its headers."""
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]], r.headers


def text_of(chunk: dict[str, Any]) -> str:
    choice = chunk["choices"][0] if chunk["choices"] else {}
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def ids_of(chunk: dict[str, Any]) -> list[int]:
    return chunk["choices"][0].get("token_ids", []) if chunk["choices"] else []


def request(path: str, sampling: dict[str, Any]) -> dict[str, Any]:
    body = {
        "model": "m", "max_tokens": TOKENS, "ignore_eos": True, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True}, "stop": ["zq"], **sampling,
    }  # fmt: skip
    if path == "/v1/completions":
        return body | {"prompt": PROMPT}
    return body | {"messages": [{"role": "user", "content": "Tell me about the capital of France."}]}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 1234}], ids=["greedy", "seeded"])
def test_a_resumed_stream_goes_on_with_the_tokens_and_text_of_an_undisturbed_one(
    url: str, path: str, sampling: dict[str, Any]
) -> None:
    body = request(path, sampling)
    whole, headers = stream(url, path, body)
    assert headers[RESUMABLE_HEADER] == "1"
    ids = [t for chunk in whole for t in ids_of(chunk)]
    text = "".join(text_of(chunk) for chunk in whole)
    assert len(ids) == TOKENS and whole[-1]["usage"]["completion_tokens"] == TOKENS
    got: list[int] = []
    sent = ""
    for chunk in whole:  # cut after each chunk that carried tokens: the client has what came up to it
        got += ids_of(chunk)
        sent += text_of(chunk)
        if not ids_of(chunk) or len(got) == TOKENS:
            continue
        rest, _ = stream(url, path, body | {"resume": {"token_ids": got, "text_sent": len(sent)}})
        assert [t for c in rest for t in ids_of(c)] == ids[len(got) :]
        assert sent + "".join(text_of(c) for c in rest) == text
        assert rest[-1]["usage"]["completion_tokens"] == TOKENS
        assert all("role" not in (c["choices"][0].get("delta") or {}) for c in rest if c["choices"])


def test_what_cannot_resume_is_refused_and_not_marked_resumable(url: str) -> None:
    chat = request("/v1/chat/completions", {"temperature": 0})
    resume = {"resume": {"token_ids": [5], "text_sent": 0}}
    for extra in [{"n": 2}, {"response_format": {"type": "json_object"}}, {"stream": False, "stream_options": None}]:
        r = httpx.post(url + "/v1/chat/completions", json=chat | extra | resume, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "resume", (extra, r.text)
    _, headers = stream(url, "/v1/chat/completions", chat | {"n": 2})
    assert RESUMABLE_HEADER not in headers


def test_return_token_ids_gives_the_ids_of_the_text(url: str) -> None:
    """vLLM's `return_token_ids` without a stream: each choice's output ids (and the prompt's)."""
    body = request("/v1/completions", {"temperature": 0}) | {"stream": False}
    del body["stream_options"]
    r = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    streamed, _ = stream(url, "/v1/completions", request("/v1/completions", {"temperature": 0}))
    assert r["choices"][0]["token_ids"] == [t for c in streamed for t in ids_of(c)]
    assert r["choices"][0]["prompt_token_ids"] == PROMPT
