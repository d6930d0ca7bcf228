"""Tools in a chat template. A template that reads `tools` gets what transformers passes it: the tools list,
assistant messages with `tool_calls` (their arguments as objects, as tool-use templates expect them; vLLM converts
them the same way) and `tool` messages with their `tool_call_id`.

A template that never reads `tools` (SmolLM2-135M-Instruct's, and most made before tool use) gets a fallback in
the Hermes format the `hermes` parser reads: the tools, with Hermes's instructions, in the system message (after
the request's own system text, if any); each assistant call in the assistant's text as a
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` block; each tool result as a user message holding a
`<tool_response>` block (a user turn, so any template renders it).
"""

from __future__ import annotations

import json
from contextlib import suppress
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta

FALLBACK_INSTRUCTIONS = (
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    "Here are the available tools, one JSON object a line, within <tools></tools> XML tags:\n<tools>\n{tools}\n"
    "</tools>\nFor each function call, return a JSON object with the function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}'
    "\n</tool_call>"
)


@lru_cache(maxsize=32)
def reads_tools(source: str) -> bool:
    """Whether a template's source reads the `tools` variable."""
    return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(source))


def _with_object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    calls = []
    for call in message["tool_calls"]:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with suppress(ValueError):  # not JSON: the template gets the text as it came
                function["arguments"] = json.loads(arguments) if arguments else {}
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def _call_block(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": function.get("arguments", {})}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def _fallback(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        if m.get("tool_calls"):
            text = "\n".join([m.get("content") or "", *map(_call_block, m["tool_calls"])]).strip()
            out.append({"role": m["role"], "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"})
        else:
            out.append(m)
    if tools:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = FALLBACK_INSTRUCTIONS.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def with_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, source: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools a template of `source` is rendered with (the module docstring says how)."""
    messages = [_with_object_arguments(m) if m.get("tool_calls") else m for m in messages]
    uses_tools = tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not uses_tools or reads_tools(source):
        return messages, tools
    return _fallback(messages, tools), None
