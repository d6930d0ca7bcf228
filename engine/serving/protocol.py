"""Request models of the OpenAI completions and chat APIs, with vLLM's extensions (their answers' bodies:
engine/serving/answer_bodies.py).

Requests are validated strictly: a token id is an integer (not `false`, not `1.5`), a number is not a
string. So /openapi.json, which these models generate, says what the server accepts.

Unknown fields are ignored, as OpenAI-compatible servers do so that newer clients keep working, except
those in `UNSUPPORTED`: fields of OpenAI's or vLLM's API whose value would change the answer and that this
server does not implement (audio, web search, ...). Set to anything but a
harmless value, such a field is a 400 naming it, never silently dropped. engine/serving/api_fields.py lists
the API's fields that never change the answer here; every other field of both APIs is declared below and
implemented (tests/test_api_fields.py holds that, field by field); the structured-output and tool fields are
declared in engine/serving/structured_fields.py and engine/serving/tools.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from engine.core.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.serving.api_fields import UNSUPPORTED_OPTIONS
from engine.serving.errors import bad_request
from engine.serving.structured_fields import StructuredOutputFields
from engine.serving.tools import ToolFields

MAX_N = 128  # OpenAI's bound on n: each choice is an engine request

# field -> the values that change nothing (None never does); any other value is a 400 naming the field
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    **UNSUPPORTED_OPTIONS,  # the rest of the API's: engine/serving/api_fields.py says why each is refused
}

LOGIT_BIAS_BOUND = 100.0  # OpenAI's range for a bias; vLLM clamps a value outside it to the bound
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # beam search draws 2 * width candidates a step, as logprobs


def _integral(value: Any) -> Any:
    """JSON Schema's `integer` takes 3.0; strict mode otherwise refuses it (and still refuses true and "3")."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds: int) -> Any:
    """An integer field; its bounds go before the validator, or the schema would not show them."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


Int = integer()
Count = integer(ge=1)  # max_tokens and friends: at least one token
TOKEN_ID_MARK = "x-token-id"  # replaced by the vocabulary's bound in /openapi.json (bound_token_ids)
# The vocabulary check itself answers 400 `invalid_token_id` (openai_routes), so the bounds live in the
# schema only: pydantic would answer the same 400 with another code.
TokenId = Annotated[int, Field(json_schema_extra={"minimum": 0, TOKEN_ID_MARK: True}), BeforeValidator(_integral)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def bound_token_ids(schema: Any, vocab_size: int | None) -> Any:
    """Give every prompt token id in an OpenAPI schema the model's bound, so a schema-valid id is one the
    model has."""
    if isinstance(schema, dict):
        if schema.pop(TOKEN_ID_MARK, False) and vocab_size is not None:
            schema["maximum"] = vocab_size - 1
        for value in schema.values():
            bound_token_ids(value, vocab_size)
    elif isinstance(schema, list):
        for value in schema:
            bound_token_ids(value, vocab_size)
    return schema


TokenIdLists = Annotated[list[TokenIds], Field(min_length=1)]
# a token id as a JSON key (the vocabulary bounds it in the engine), to a finite bias
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, Field(allow_inf_nan=False)]],
    Field(json_schema_extra={"additionalProperties": False}),
]
Text = Annotated[str, Field(min_length=1)]  # an empty prompt has no token to start from


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(Strict):
    include_usage: bool = False


class ResumeFields(Strict):
    """Headroom's: this request is a stream whose replica died, re-sent by the fleet's ingress
    (engine/serving/ray_serve/resend.py) with the tokens the client got (`token_ids`, from vLLM's
    `return_token_ids`) and how many characters of their text it got. The answer goes on from there."""

    token_ids: Annotated[list[integer(ge=0)], Field(min_length=1)]
    text_sent: integer(ge=0)


class SamplingFields(Strict, StructuredOutputFields):
    """The fields both endpoints share, with OpenAI's defaults; vLLM's extensions at the end."""

    model: str | None = None
    # Per-field bounds are in the schema, so a schema-valid request is one the engine takes.
    temperature: Annotated[float, Field(ge=0)] | None = None  # None: 1.0, as OpenAI
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: integer(ge=1, le=MAX_N) = 1
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None  # None: 0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None  # None: 0
    # vLLM extensions
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None  # None: 1 (off)
    top_k: integer(ge=-1) | None = None
    ignore_eos: bool = False
    min_tokens: integer(ge=0) = 0
    stop_token_ids: list[integer(ge=0)] | None = None
    include_stop_str_in_output: bool = False
    # vLLM's logits controls, prompt logprobs, detokenization, prompt truncation and beam search (issue #42)
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None  # None: 0 (off)
    logit_bias: LogitBias | None = None  # OpenAI's: token id (a JSON key) -> bias, clamped to [-100, 100]
    allowed_token_ids: TokenIds | None = None
    bad_words: list[Text] | None = None
    prompt_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None  # not with `stream`, as vLLM
    echo: bool = False  # completions: the prompt before the text; chat: the last message, if it is the role's
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Literal[-1] | Count | None = None  # keep k prompt tokens; -1: all the context leaves
    truncation_side: Literal["left", "right"] | None = None  # left (None): keep the last k; right: the first k
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:N"
    return_token_ids: bool | None = None  # each choice's (each chunk's) output ids, and the prompt's
    resume: ResumeFields | None = None  # Headroom's: a stream another replica began
    use_beam_search: bool = False  # vLLM's: n beams, not streamed
    length_penalty: Annotated[float, Field(ge=-20, le=20)] = 1.0  # beam search: logprob / length ** length_penalty
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # the answer's id, after its prefix

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise bad_request("stop strings must not be empty", "stop")
        return stops

    def check_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            harmless = UNSUPPORTED.get(name)
            if harmless is not None and value is not None and value not in harmless:
                allowed = ", ".join(map(repr, harmless)) or "null"
                raise bad_request(
                    f"{name} is not supported by this server (accepted only as: {allowed})", name, "unsupported_field"
                )

    def check_rules(self) -> None:
        """vLLM's checks across fields (each a 400 naming the field)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options can only be set when stream is true", "stream_options")
        if self.stream and self.prompt_logprobs:
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        if self.use_beam_search and self.stream:
            raise bad_request("streaming is not supported with beam search", "use_beam_search")
        if self.use_beam_search and not 1 <= self.n <= MAX_BEAM_WIDTH:
            raise bad_request(f"beam search takes n (its width) in [1, {MAX_BEAM_WIDTH}]", "n")
        if self.length_penalty != 1 and not self.use_beam_search:
            raise bad_request("length_penalty applies to beam search only (use_beam_search)", "length_penalty")
        if self.resume is not None and not self.resumable:
            raise bad_request("only a stream of one choice without echo or prompt logprobs resumes", "resume")

    @property
    def resumable(self) -> bool:
        """A stream the fleet's ingress can resume on another replica: one choice, its text the generated tokens'
        alone (chat's tool calls and structured outputs are checked where they are planned)."""
        return self.stream and self.n == 1 and not (self.use_beam_search or self.echo or self.prompt_logprobs)

    def engine_logit_bias(self) -> dict[int, float]:
        """OpenAI's keys (digits, by the schema) as token ids; each bias clamped to [-100, 100], as vLLM does."""
        bound = LOGIT_BIAS_BOUND
        return {int(token): min(bound, max(-bound, bias)) for token, bias in (self.logit_bias or {}).items()}

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        bad_words_token_ids: list[list[int]] | None,
    ) -> SamplingParams:
        """Engine parameters for a prompt's first choice (`for_sample` makes the others). Range checks run in
        the engine (RequestError -> 400 with `param`)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=self.stop_list(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=logprobs,
            min_p=self.min_p or 0.0,
            logit_bias=self.engine_logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=list(self.bad_words or []),
            bad_words_token_ids=bad_words_token_ids,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    @staticmethod
    def for_sample(params: SamplingParams, sample: int) -> SamplingParams:
        """The `sample`-th choice's: with a seed, sample j uses seed + j, as vLLM's parallel sampling does."""
        return params if params.seed is None or not sample else replace(params, seed=params.seed + sample)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1)] | TokenIdLists
    max_tokens: integer(ge=0) | None = 16  # OpenAI's default for completions; 0 only with echo (score the prompt)
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None  # top k besides the chosen token
    add_special_tokens: bool = True  # vLLM: completions get BOS

    @property
    def generates(self) -> bool:
        """False for vLLM's echo with max_tokens 0: the answer is the prompt alone (the engine's one token, run
        to score the prompt, left out)."""
        return self.max_tokens != 0

    def engine_max_tokens(self) -> int | None:
        if not self.generates and not self.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo)", "max_tokens")
        return self.max_tokens if self.generates else 1

    def engine_prompt_logprobs(self) -> int | None:
        """vLLM's: prompt_logprobs, else with echo the logprobs' k (the prompt's logprobs lead the answer's). A
        stream shows them only that way: otherwise it does not score the prompt."""
        echoed = self.echo and self.logprobs is not None
        if self.stream and not echoed:
            return None
        return self.prompt_logprobs if self.prompt_logprobs is not None else self.logprobs if echoed else None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt, as text or token ids (one prompt is a batch of one)."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(Strict):
    type: Literal["text"]  # image and audio parts would change the answer: not served, so not in the schema
    text: str


Content = str | list[TextPart]


class _Message(Strict):
    """A chat message, one class per role so the schema says what each role needs (a schema-valid message is
    one the server takes)."""

    role: str
    content: Content | None = None
    tool_call_id: str | None = None  # tool messages answer this call
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, as the template may render them

    def as_template_input(self) -> dict[str, Any]:
        """What the chat template sees: `developer` is OpenAI's newer name for `system`."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content}
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


class InstructionMessage(_Message):
    role: Literal["system", "developer", "user"]
    content: Content


class AssistantMessage(_Message):
    """OpenAI: content is required unless the turn called tools. The schema says it with anyOf, the
    validator enforces it."""

    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array"}}},
            ]
        }
    )
    role: Literal["assistant"]
    tool_calls: Annotated[list[dict[str, Any]], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> AssistantMessage:
        if self.content is None and self.tool_calls is None:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


ChatMessage = Annotated[InstructionMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


# vLLM refuses kwargs that would replace the template or its tokenizing
TemplateKwargs = Annotated[
    dict[str, Any], Field(json_schema_extra={"propertyNames": {"not": {"enum": ["chat_template", "tokenize"]}}})
]


class ChatCompletionRequest(SamplingFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None
    add_special_tokens: bool = False  # vLLM: the chat template already writes BOS

    # vLLM's chat template options
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the model continues the final message: no generation prompt
    chat_template: str | None = None  # a Jinja template for this request, in the same sandbox as the model's
    chat_template_kwargs: TemplateKwargs | None = None  # more names the template reads
    documents: list[dict[str, str]] | None = None  # for templates that render retrieved documents
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    def resolved_max_tokens(self) -> int | None:
        """None means 'up to the context' (OpenAI's chat default)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_prompt_logprobs(self) -> int | None:
        """vLLM's: prompt_logprobs, else with echo the top_logprobs' k (the answer's `prompt_logprobs`); a stream
        never shows them, so it does not score the prompt."""
        if self.stream or (self.prompt_logprobs is None and not self.echo):
            return None
        return self.prompt_logprobs if self.prompt_logprobs is not None else self.top_logprobs or 0

    @property
    def role(self) -> str:
        """The answer's role, as vLLM names it: the assistant's, else (no generation prompt) the last message's."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def engine_logprobs(self) -> int | None:
        """The engine's k (top entries besides the chosen token), or None when logprobs are off."""
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
