"""No request field is silently ignored: every field of the official openai client's request types
(`openai.types.completion_create_params`, `openai.types.chat.completion_create_params`) and every vLLM extra
(engine/serving/api_fields.py `VLLM_EXTRA_FIELDS`), on its endpoint, is one of:

- implemented: declared by the request model, and a value of it (`EFFECTS`) changes the answer or what the
  engine was asked (the prompt's token ids or the sampling parameters) against the same request without it;
- refused: in `UNSUPPORTED`, and a value that is not harmless is a 400 naming it;
- ignored: in `IGNORED` (it never changes the answer here), and the engine is asked the same with it.

Against an in-process server over a model-free backend (tests/test_openai_parity.py's, with logprobs) and a
real tokenizer with BOS (tests/test_special_tokens_api.py's), so the engine's side of each request is read.
"""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from engine.baselines.seed import FixedPolicy
from engine.core.llm_engine import LLMEngine
from engine.serving.api_fields import IGNORED, VLLM_EXTRA_FIELDS
from engine.serving.app import create_app
from engine.serving.async_engine import AsyncEngine
from engine.serving.beam_search import Beam, BeamSearch
from engine.serving.context import AppContext
from engine.serving.protocol import UNSUPPORTED, ChatCompletionRequest, CompletionRequest
from tests.inproc_server import serve_in_thread
from tests.test_openai_parity import LogprobBackend
from tests.test_special_tokens_api import llama_style_tokenizer

COMPLETION, CHAT = "/v1/completions", "/v1/chat/completions"
MODELS = {COMPLETION: CompletionRequest, CHAT: ChatCompletionRequest}
BASE = {
    COMPLETION: {"prompt": "Hello world, hello there", "max_tokens": 3, "temperature": 0},
    CHAT: {"messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 3, "temperature": 0},
}
SHOW = "{% for m in messages %}{{ m.content }}{% endfor %}{{ documents }}{{ greeting }}{{ reasoning_effort }}"
ASSISTANT_LAST = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
TOOL = {"type": "function", "function": {"name": "f"}}
WITH_TOOLS = {"chat_template": SHOW + "{{ tools }}"}  # a template that reads the tools (no fallback system text)

# field -> (what the request sets besides the base, the value under test), on both endpoints unless keyed by one
EFFECTS: dict[str, tuple[dict, object]] = {
    "model": ({}, "default"),
    "temperature": ({}, 0.7),
    "top_p": ({"temperature": 1.0}, 0.5),
    "seed": ({"temperature": 1.0}, 3),
    "stop": ({}, ["x"]),
    "stream": ({}, True),
    "stream_options": ({"stream": True}, {"include_usage": True}),
    "n": ({"temperature": 1.0}, 2),
    "presence_penalty": ({}, 1.0),
    "frequency_penalty": ({}, 1.0),
    "max_tokens": ({}, 5),
    "repetition_penalty": ({}, 1.2),
    "top_k": ({"temperature": 1.0}, 5),
    "ignore_eos": ({}, True),
    "min_tokens": ({}, 2),
    "stop_token_ids": ({}, [7]),
    "include_stop_str_in_output": ({"stop": ["x"]}, True),
    "add_special_tokens": ({}, False),
    "min_p": ({"temperature": 1.0}, 0.2),
    "logit_bias": ({}, {"5": 10}),
    "allowed_token_ids": ({}, [5, 6]),
    "bad_words": ({}, ["world"]),
    "prompt_logprobs": ({}, 1),
    "echo": ({}, True),
    "skip_special_tokens": ({}, False),
    "spaces_between_special_tokens": ({}, False),
    "truncate_prompt_tokens": ({}, 2),
    "truncation_side": ({"truncate_prompt_tokens": 2}, "right"),
    "return_tokens_as_token_ids": ({"logprobs": 1}, True),
    "return_token_ids": ({}, True),
    "use_beam_search": ({}, True),
    "request_id": ({}, "mine"),
    "logprobs": ({}, 1),
    # chat
    "max_completion_tokens": ({}, 5),
    "top_logprobs": ({"logprobs": True}, 2),
    "add_generation_prompt": ({}, False),
    "continue_final_message": ({"messages": ASSISTANT_LAST, "add_generation_prompt": False}, True),
    "chat_template": ({}, SHOW),
    "chat_template_kwargs": ({"chat_template": SHOW}, {"greeting": "hi"}),
    "documents": ({"chat_template": SHOW}, [{"title": "a", "text": "b"}]),
    "reasoning_effort": ({"chat_template": SHOW}, "low"),
    # structured outputs and tools (engine/serving/structured_fields.py, engine/serving/tools.py)
    "response_format": ({}, {"type": "json_object"}),
    "guided_json": ({}, {"type": "object"}),
    "guided_regex": ({}, "[a-z]+"),
    "guided_choice": ({}, ["yes", "no"]),
    "guided_grammar": ({}, 'root ::= "yes" | "no"'),
    "structured_outputs": ({}, {"regex": "[a-z]+"}),
    "tools": (WITH_TOOLS, [TOOL]),  # the template renders them
    "tool_choice": ({**WITH_TOOLS, "tools": [TOOL]}, "required"),
    "functions": (WITH_TOOLS, [TOOL["function"]]),
    "function_call": ({**WITH_TOOLS, "functions": [TOOL["function"]]}, {"name": "f"}),
    "parallel_tool_calls": ({**WITH_TOOLS, "tools": [TOOL], "tool_choice": "required"}, False),
}
CHAT_EFFECTS = {
    "echo": ({"messages": ASSISTANT_LAST}, True),
    "logprobs": ({}, True),
    "add_special_tokens": ({}, True),
    "return_tokens_as_token_ids": ({"logprobs": True}, True),
}
# Declared, and shown elsewhere to change the answer: beam search's ranking (below).
EFFECT_ELSEWHERE = {"length_penalty"}
REQUIRED = {"prompt", "messages"}


def fields(path: str) -> set[str]:
    params = completion_create_params if path == COMPLETION else chat_create_params
    openai_fields = set(typing.get_type_hints(params.CompletionCreateParamsBase)) | {"stream"}
    return openai_fields | VLLM_EXTRA_FIELDS["completions" if path == COMPLETION else "chat"]


class Served:
    def __init__(self, url: str, backend: LogprobBackend) -> None:
        self.url, self.backend = url, backend

    def ask(self, path: str, body: dict) -> tuple[httpx.Response, list]:
        """The answer, and what the engine was asked: each of its requests' prompt and sampling parameters."""
        seen = {it.request_id for batch in self.backend.steps for it in batch.items}
        r = httpx.post(self.url + path, json=body, timeout=60)
        asked = {}
        for batch in self.backend.steps:
            for it in batch.items:
                if it.request_id not in seen:
                    asked.setdefault(it.request_id, (list(it.prompt_ids), it.params))
        return r, sorted(asked.values(), key=repr)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tokenizer = llama_style_tokenizer(Path(tmp_path_factory.mktemp("tok")) / "tok")
    backend = LogprobBackend(num_blocks=256, block_size=4, max_model_len=256)
    engine = AsyncEngine(LLMEngine(backend, FixedPolicy()), max_waiting=64)
    ctx = AppContext(
        engine, model_name="fake", tokenizer=tokenizer, vocab_size=tokenizer.vocab_size, other_names=("default",),
        tool_call_parser="hermes",  # tools without a tool_choice are auto: a 400 without a parser
        trust_request_chat_template=True,  # chat_template's effect is shown with the request's own template
    )  # fmt: skip
    app = create_app(ctx)
    with serve_in_thread(app) as url:
        yield Served(url, backend)


def shown(r: httpx.Response) -> object:
    """The answer without what differs between any two answers (the time, a generated id)."""
    if r.headers["content-type"].startswith("text/event-stream"):
        return [shown_body(json.loads(line[6:])) for line in r.text.splitlines() if line.startswith("data: {")]
    return shown_body(r.json())


def shown_body(body: dict) -> dict:
    random_id = re.fullmatch(r"[a-z]+-[0-9a-f]{32}", body.get("id") or "")
    return {k: v for k, v in body.items() if k != "created" and not (k == "id" and random_id)}


CASES = [(path, name) for path in (COMPLETION, CHAT) for name in sorted(fields(path) - REQUIRED)]


@pytest.mark.parametrize(("path", "name"), CASES, ids=[f"{'chat' if p == CHAT else 'cmpl'}-{n}" for p, n in CASES])
def test_every_field_is_implemented_refused_or_ignored(served: Served, path: str, name: str) -> None:
    declared = name in MODELS[path].model_fields
    if name in IGNORED:
        assert not declared and name not in UNSUPPORTED
        base, value = BASE[path], {"k": "v"}
        (r0, asked0), (r1, asked1) = served.ask(path, base), served.ask(path, {**base, name: value})
        assert r1.status_code == 200 and shown(r1) == shown(r0) and asked1 == asked0, name
    elif name in UNSUPPORTED:
        assert not declared
        r = served.ask(path, {**BASE[path], name: {"not": "harmless"}})[0]
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    else:
        assert declared, f"{name} is neither implemented, refused nor ignored"
        if name in EFFECT_ELSEWHERE:
            return
        extra, value = (CHAT_EFFECTS if path == CHAT and name in CHAT_EFFECTS else EFFECTS)[name]
        base = {**BASE[path], **extra}
        (r0, asked0), (r1, asked1) = served.ask(path, base), served.ask(path, {**base, name: value})
        assert r0.status_code == r1.status_code == 200, (r0.text, r1.text)
        assert shown(r1) != shown(r0) or asked1 != asked0, f"{name}={value!r} changed nothing"


def test_length_penalty_ranks_beams_by_their_length() -> None:
    """Beam search's score: vLLM's cumulative logprob over the sequence's length ** length_penalty."""
    long, short = Beam([5, 6, 7, 8], cum_logprob=-4.0), Beam([5], cum_logprob=-1.5)

    def best(penalty: float) -> Beam:
        search = BeamSearch(2, 4, 1.0, penalty, False, False, frozenset({0}))
        return max((long, short), key=lambda b: search.score(b, prompt_len=2))

    assert best(1.0) is short and best(3.0) is long
