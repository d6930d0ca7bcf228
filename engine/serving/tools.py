"""Tool calling as vLLM serves it: `tools` with `tool_choice` none, auto, required or a named function, and
OpenAI's older `functions` / `function_call`.

- The chat template renders the tools (engine/model/tokenizer.py), whatever the choice, as vLLM does by default.
- `required` and a named function are grammar-constrained (engine/core/structured.py): the output is a JSON array
  of {"name", "parameters"} objects built from the tools' parameter schemas (vLLM's schema), or the named
  function's arguments object, so the arguments always parse against the schema.
- `auto` lets the model write freely, and the server's `--tool-call-parser` finds the calls in its text
  (engine/serving/tool_parsers.py); without one, `auto` with tools is a 400, as vLLM answers.
- `none` leaves the text as content.

An answer with calls carries `message.tool_calls` (ids `call_...`, type function, arguments as JSON text) and
finish_reason "tool_calls"; asked with `functions`, it carries OpenAI's older `function_call` and
"function_call". A stream sends each call's id, type and name first, then its arguments in fragments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.core.sampling_params import StructuredOutput
from engine.serving.errors import bad_request
from engine.serving.tool_parsers import CallDelta, NamedParser, RequiredParser, ToolParser, auto_parser

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # required and named calls are always grammar-constrained


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
FunctionCall = Literal["none", "auto"] | FunctionName


class ToolFields(_Strict):
    """The chat request's tool fields (engine/serving/protocol.py's ChatCompletionRequest takes them from here)."""

    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: auto with tools, none without
    functions: Annotated[list[FunctionDefinition], Field(min_length=1)] | None = None  # OpenAI's older tools
    function_call: FunctionCall | None = None  # OpenAI's older tool_choice
    parallel_tool_calls: bool | None = None  # False: at most one call

    def tool_plan(self, parser: str | None) -> ToolPlan | None:
        """What the tools make of the prompt, the grammar and the answer; None without tools."""
        return plan(self, parser)

    def functions_asked(self) -> list[FunctionDefinition]:
        """The functions of `tools`, or of OpenAI's older `functions`."""
        return [t.function for t in self.tools or []] or list(self.functions or [])

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (OpenAI's shape; `functions` as tools); None without."""
        tools = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions_asked()]
        return tools or None


def _call_schema(fn: FunctionDefinition) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [fn.name]}, "parameters": fn.parameters or EMPTY_PARAMETERS},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def required_schema(functions: list[FunctionDefinition], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for `required`: an array of at least one {"name", "parameters"} object, each one of the tools
    (their `$defs` hoisted to the top, where their `$ref`s point)."""
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [_call_schema(f) for f in functions]}}
    if not parallel:
        schema["maxItems"] = 1
    defs: dict[str, Any] = {}
    for fn in functions:
        definitions = (fn.parameters or {}).get("$defs", {})
        if not isinstance(definitions, dict):
            raise bad_request(f"{fn.name}'s parameters: $defs must be an object", "tools")
        for name, definition in definitions.items():
            if defs.setdefault(name, definition) != definition:
                raise bad_request(f"tools define $defs {name!r} twice, differently", "tools")
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools make of its prompt, its grammar and its answer."""

    functions: list[FunctionDefinition]  # the tools' functions (the chat template reads them as tools)
    choice: str  # none, auto, required or named
    named: FunctionDefinition | None = None
    parser: str | None = None  # auto: the server's --tool-call-parser
    parallel: bool = True
    legacy: bool = False  # asked with `functions`: answered with `function_call`

    def structured(self) -> StructuredOutput | None:
        """The grammar of `required` and of a named function; None for auto and none."""
        if self.named is not None:
            return StructuredOutput("json", json.dumps(self.named.parameters or EMPTY_PARAMETERS, ensure_ascii=False))
        if self.choice == "required":
            schema = required_schema(self.functions, self.parallel)
            return StructuredOutput("json", json.dumps(schema, ensure_ascii=False))
        return None

    def parser_for_choice(self) -> ToolParser | None:
        """A fresh parser for one choice's text; None where the text is all content."""
        if self.named is not None:
            return NamedParser(self.named.name)
        if self.choice == "required":
            return RequiredParser()
        return auto_parser(self.parser) if self.choice == "auto" and self.parser else None


def plan(req: Any, parser: str | None) -> ToolPlan | None:
    """The request's tool plan (None without tools), with vLLM's checks, each a 400 naming its field."""
    if req.tools is not None and req.functions is not None:
        raise bad_request("send tools or functions, not both", "functions")
    legacy = req.functions is not None
    functions = req.functions_asked()
    choice: Any = req.function_call if legacy else req.tool_choice
    field = "function_call" if legacy else "tool_choice"
    if not functions:
        if choice not in (None, "none"):
            raise bad_request(f"{field} needs {'functions' if legacy else 'tools'}", field)
        return None
    parallel = req.parallel_tool_calls is not False and not legacy
    if choice is None:
        choice = "auto"
    if isinstance(choice, NamedToolChoice | FunctionName):
        name = choice.function.name if isinstance(choice, NamedToolChoice) else choice.name
        named = next((f for f in functions if f.name == name), None)
        if named is None:
            raise bad_request(f"{field} names {name!r}, which is not among the tools", field)
        return ToolPlan(functions, "named", named, parallel=parallel, legacy=legacy)
    if choice == "auto" and parser is None:
        raise bad_request(f'"auto" {field.replace("_", " ")} needs the server started with --tool-call-parser', field)
    return ToolPlan(functions, choice, parser=parser, parallel=parallel, legacy=legacy)


def answer_message(plan: ToolPlan, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A non-streamed choice's message fields and finish reason, from its whole text."""
    parser = plan.parser_for_choice()
    if parser is None:
        return {"content": text}, reason
    content, calls = parser.result(text)
    if not calls:
        return {"content": text}, reason
    if not plan.parallel:
        calls = calls[:1]
    if plan.legacy:
        fn = calls[0].as_dict()["function"]
        return {"content": content, "function_call": fn}, "function_call"
    return {"content": content, "tool_calls": [c.as_dict() for c in calls]}, "tool_calls"


class ChoiceStream:
    """One streamed choice's deltas: its content and tool-call deltas as the text arrives. Logprobs ride on the
    next chunk sent, so none is lost to text held back."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parser = plan.parser_for_choice()
        self._logprobs: dict | None = None

    def deltas(self, index: int, text: str, logprobs: dict | None, reason: str | None) -> list[dict[str, Any]]:
        if logprobs is not None:
            self._logprobs = logprobs if self._logprobs is None else _merged(self._logprobs, logprobs)
        content, calls = self.parser.feed(text) if self.parser else (text, [])
        if reason is not None and self.parser is not None:
            more_content, more_calls = self.parser.finish()
            content, calls = content + more_content, calls + more_calls
        if not self.plan.parallel:
            calls = [c for c in calls if c.index == 0]
        out = [self._chunk(index, {"content": content})] if content else []
        out += [self._chunk(index, self._call_delta(c)) for c in calls]
        if reason is not None:
            called = self.parser is not None and any(call.result() for call in self.parser.calls)
            final = ("function_call" if self.plan.legacy else "tool_calls") if called else reason
            out.append({"index": index, "delta": {}, "logprobs": self._take_logprobs(), "finish_reason": final})
        return out

    def _call_delta(self, call: CallDelta) -> dict[str, Any]:
        if self.plan.legacy:
            return {"function_call": call.as_dict()["function"]}
        return {"tool_calls": [call.as_dict()]}

    def _chunk(self, index: int, delta: dict[str, Any]) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": self._take_logprobs(), "finish_reason": None}

    def _take_logprobs(self) -> dict | None:
        logprobs, self._logprobs = self._logprobs, None
        return logprobs


def _merged(a: dict, b: dict) -> dict:
    """Two chat logprobs pieces as one ({"content": [...]} each)."""
    return {**a, "content": [*(a.get("content") or []), *(b.get("content") or [])]}
