"""The request fields that ask for structured outputs, as the engine's one `StructuredOutput`: OpenAI's
`response_format` (`json_object`, `json_schema` with `strict`), vLLM's older `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar`, and vLLM's `structured_outputs` object (json, regex, choice, grammar,
json_object). At most one of them per request; the spec is compiled before the request reaches the engine, so a
bad schema, regex or grammar is a 400 that names the field it came in.

Where Headroom's defaults differ from vLLM's, the request can say otherwise: JSON is written compact (", " and
": ", no other whitespace; `structured_outputs.disable_any_whitespace: false` allows any), and objects are closed
(no property the schema does not name; `strict: false` or `structured_outputs.disable_additional_properties:
false` leaves them as the schema says).
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.core.sampling_params import ParamError, StructuredOutput
from engine.core.structured import GrammarError, grammars_for
from engine.serving.errors import bad_request, shorten

Schema = dict[str, Any] | str  # a JSON schema, or its JSON text (vLLM's guided_json takes both)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # None or True: closed objects; False: as the schema says


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Strict):
    """vLLM's StructuredOutputsParams; exactly one of json, regex, choice, grammar, json_object."""

    json_: Schema | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # None: Headroom's compact JSON; False: any whitespace
    disable_additional_properties: bool | None = None  # None or True: closed objects
    disable_fallback: bool = False  # there is one backend: nothing to fall back from
    whitespace_pattern: None = None  # not served: a custom whitespace regex
    structural_tag: None = None  # not served: tag-triggered grammars


class StructuredOutputFields(_Strict):
    """The request fields of both endpoints that ask for a structured output (engine/serving/protocol.py's
    SamplingFields takes them from here)."""

    response_format: ResponseFormat | None = None  # OpenAI's; {"type": "text"} asks for nothing
    guided_json: Schema | None = None  # vLLM's older fields, one each
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None  # Lark, or GBNF
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's newer form

    def structured_output(self) -> tuple[StructuredOutput, str] | None:
        """The structured output asked for and the field that asked; None for free text. Two fields that both
        ask are a 400."""
        return requested(self)


def _schema_text(schema: Schema, field: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise bad_request(f"{field} is not valid JSON: {e}", field) from e
    if not isinstance(schema, dict):
        raise bad_request(f"{field} must be a JSON schema object", field)
    return json.dumps(schema, ensure_ascii=False)


def _from_structured_outputs(so: StructuredOutputsParams) -> StructuredOutput:
    kinds = [name for name in ("json_", "regex", "choice", "grammar") if getattr(so, name) is not None]
    kinds += ["json_object"] if so.json_object else []
    if len(kinds) != 1:
        raise bad_request("structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                          "structured_outputs")  # fmt: skip
    kind = kinds[0].rstrip("_")
    if kind == "json":
        value = _schema_text(so.json_, "structured_outputs.json")  # type: ignore[arg-type]
    elif kind == "choice":
        value = json.dumps(so.choice, ensure_ascii=False)
    else:
        value = "" if kind == "json_object" else getattr(so, kind)
    return _spec(kind, value, so.disable_additional_properties is not False, so.disable_any_whitespace is False)


def _spec(kind: str, value: str, strict: bool = True, any_whitespace: bool = False) -> StructuredOutput:
    try:
        return StructuredOutput(kind, value, strict, any_whitespace)
    except ParamError as e:
        raise bad_request(str(e), e.param) from e


def requested(fields: Any) -> tuple[StructuredOutput, str] | None:
    """The request's structured output and the field that asked for it; None for free text. Two fields that both
    ask are a 400."""
    asked: list[tuple[StructuredOutput, str]] = []
    fmt: ResponseFormat | None = fields.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append((_spec("json_object", ""), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request("response_format json_schema needs its json_schema", "response_format")
        schema = _schema_text(fmt.json_schema.schema_, "response_format")
        asked.append((_spec("json", schema, fmt.json_schema.strict is not False), "response_format"))
    if fields.guided_json is not None:
        asked.append((_spec("json", _schema_text(fields.guided_json, "guided_json")), "guided_json"))
    if fields.guided_regex is not None:
        asked.append((_spec("regex", fields.guided_regex), "guided_regex"))
    if fields.guided_choice is not None:
        asked.append((_spec("choice", json.dumps(fields.guided_choice, ensure_ascii=False)), "guided_choice"))
    if fields.guided_grammar is not None:
        asked.append((_spec("grammar", fields.guided_grammar), "guided_grammar"))
    if fields.structured_outputs is not None:
        asked.append((_from_structured_outputs(fields.structured_outputs), "structured_outputs"))
    if len(asked) > 1:
        raise bad_request(f"{asked[0][1]} and {asked[1][1]} both ask for a structured output: send one",
                          asked[1][1])  # fmt: skip
    return asked[0] if asked else None


async def compile_spec(tokenizer: Any, vocab_size: int | None, spec: StructuredOutput, field: str) -> None:
    """Compile the spec now, off the event loop (a large grammar takes a while), so the engine thread finds it
    compiled; a spec that does not compile is a 400 naming `field`."""
    try:
        grammars = await asyncio.to_thread(grammars_for, tokenizer, vocab_size or tokenizer.vocab_size)
        await asyncio.to_thread(grammars.compile, spec)
    except GrammarError as e:
        raise bad_request(f"{field}: {shorten(str(e), 500)}", field, "invalid_structured_output") from e


async def structured_of(ctx: Any, req: Any, tools: Any = None) -> StructuredOutput | None:
    """The request's structured output, compiled: the one its fields ask for, or its tools' (`required` or a
    named function: engine/serving/tools.py); None for free text. Both at once is a 400."""
    asked = req.structured_output()
    from_tools = tools.structured() if tools is not None else None
    if asked is not None and from_tools is not None:
        raise bad_request(f"{asked[1]} cannot be combined with tool_choice required or a named function", asked[1])
    spec, field = asked if asked is not None else (from_tools, "tools")
    if spec is None:
        return None
    if req.use_beam_search:
        raise bad_request("beam search does not take a structured output", field)
    await compile_spec(ctx.tokenizer, ctx.vocab_size, spec, field)
    return spec
