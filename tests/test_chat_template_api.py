"""vLLM's chat template options through the real server (the default model's ChatML template): the prompt the
engine got is read back from its prompt logprobs' decoded tokens. add_generation_prompt, continue_final_message
(and the answer's role), a request's own chat_template in the sandbox (with its limits), chat_template_kwargs,
documents, reasoning_effort, and chat's echo, streamed and not."""

from __future__ import annotations

import json
import time

import httpx
import pytest

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "What is the capital of France?"}]
SHOW = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if documents %}docs: {{ documents | map(attribute='title') | join(',') }}\n{% endif %}"
    "{% if greeting is defined %}greeting: {{ greeting }}\n{% endif %}"
    "{% if reasoning_effort is defined %}effort: {{ reasoning_effort }} thinking: {{ enable_thinking }}\n{% endif %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def post(server, body: dict) -> httpx.Response:  # noqa: ANN001
    return httpx.post(server.url + CHAT, json={"max_tokens": 4, "temperature": 0, **body}, timeout=120)


def prompt_of(server, body: dict) -> tuple[str, dict]:  # noqa: ANN001
    """The prompt text the engine got, but for its first token (which has no logprob), from the answer's
    prompt_logprobs; and the answer."""
    r = post(server, {**body, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    scored = r.json()["prompt_logprobs"]
    assert scored[0] is None
    return "".join(next(iter(s.values()))["decoded_token"] for s in scored[1:]), r.json()


def test_add_generation_prompt_and_the_answer_s_role(server) -> None:  # noqa: ANN001
    with_prompt, _ = prompt_of(server, {"messages": USER})
    without, answer = prompt_of(server, {"messages": USER, "add_generation_prompt": False})
    assert with_prompt == without + "<|im_start|>assistant\n"
    assert answer["choices"][0]["message"]["role"] == "user"  # vLLM: the last message's role


def test_continue_final_message_continues_it_and_echo_shows_it(server) -> None:  # noqa: ANN001
    prefill = [*USER, {"role": "assistant", "content": "The capital of France is"}]
    body = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
    prompt, answer = prompt_of(server, body)
    assert prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    content = answer["choices"][0]["message"]["content"]
    assert content.startswith(" Paris") and answer["choices"][0]["message"]["role"] == "assistant"
    echoed = post(server, {**body, "echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "The capital of France is" + content
    with httpx.stream("POST", server.url + CHAT, json={**body, "echo": True, "stream": True, "max_tokens": 4,
                                                       "temperature": 0}, timeout=120) as r:  # fmt: skip
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "The capital of France is"}
    assert "".join(d.get("content", "") for d in deltas) == echoed
    both = post(server, {"messages": prefill, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_a_request_template_with_kwargs_documents_and_reasoning_effort(server) -> None:  # noqa: ANN001
    docs = [{"title": "Paris", "text": "capital"}, {"title": "Lyon", "text": "city"}]
    body = {"messages": USER, "chat_template": SHOW, "documents": docs, "reasoning_effort": "low",
            "chat_template_kwargs": {"greeting": "hello", "enable_thinking": "kept"}}  # fmt: skip
    prompt, _ = prompt_of(server, body)
    rendered = "[user] What is the capital of France?\ndocs: Paris,Lyon\ngreeting: hello\neffort: low thinking: kept\n"
    assert (rendered + "[assistant]").endswith(prompt) and len(prompt) > len(rendered) - 4
    effort, _ = prompt_of(server, {"messages": USER, "chat_template": SHOW, "reasoning_effort": "none"})
    assert "effort: none thinking: False" in effort
    refused = post(server, {"messages": USER, "chat_template_kwargs": {"chat_template": SHOW}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.parametrize(
    "template",
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{{ 'x' * 10**9 }}",
        "{{ 10 ** 100000000 }}",
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "{{ ''.__class__.__mro__ }}{{ messages.append(1) }}",
    ],
    ids=["nested loops", "repeat", "power", "doubling", "escape"],
)
def test_a_request_template_runs_in_the_sandbox_with_limits(server, template: str) -> None:  # noqa: ANN001
    """A client's template cannot loop, grow a value or reach Python past the sandbox: a quick 400."""
    start = time.monotonic()
    r = post(server, {"messages": USER, "chat_template": template})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert time.monotonic() - start < 10


def test_a_request_template_is_refused_where_the_server_does_not_trust_clients_with_one(twin_server) -> None:  # noqa: ANN001
    """Without --trust-request-chat-template (as vLLM): a 400 naming the field, the template never run."""
    r = httpx.post(twin_server().url + "/v1/chat/completions", json={"model": "default", "messages": USER,
                   "chat_template": SHOW, "max_tokens": 1}, timeout=30)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
