"""Per-request sampling parameters, with vLLM's SamplingParams names."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # vLLM's default max_logprobs, OpenAI's top_logprobs limit

# ---- structured outputs (issue #42): what the grammar of engine/core/structured.py is compiled from ----
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What every output token of a request must keep to (vLLM's structured outputs). Plain hashable text, so
    the compiled grammar is cached by it. `kind`: json (`value` is a JSON schema as JSON text), json_object (any
    JSON object), regex, choice (`value` is a JSON list of the strings allowed) or grammar (Lark, or llama.cpp's
    GBNF, as llguidance reads them)."""

    kind: str
    value: str = ""
    # json: True closes every object the schema leaves open (no property it does not name), as xgrammar, vLLM's
    # default backend, does; False: JSON Schema's own default (open objects), as OpenAI's `strict: false`
    strict: bool = True
    any_whitespace: bool = False  # json: any whitespace between items (vLLM's default); False: ", " and ": " only

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ParamError("structured_outputs", f"structured output kind must be one of {STRUCTURED_KINDS}")
        if self.kind != "json_object" and not self.value:
            raise ParamError("structured_outputs", f"a {self.kind} structured output needs its {self.kind}")


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the model's context
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # vLLM: keep the stop string that ended the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # vLLM: >1 discourages every token of the prompt and the output
    logprobs: int | None = None  # None: off; k: the chosen token's logprob and the top k (vLLM's meaning)
    # ---- vLLM's logits controls, prompt logprobs and detokenization (issue #42) ----
    min_p: float = 0.0  # drop tokens below min_p times the top token's probability (after temperature); 0: off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (OpenAI's)
    allowed_token_ids: list[int] | None = None  # only these may be sampled; None: all
    bad_words: list[str] = field(default_factory=list)  # text; `bad_words_token_ids` is what the sampler reads
    # each bad word as token ids (engine/frontend/bad_words.py, with and without a leading space, as vLLM
    # tokenizes them): the last id is banned where the output ends with the rest. None: not tokenized yet
    bad_words_token_ids: list[list[int]] | None = None
    prompt_logprobs: int | None = None  # None: off; k: each prompt token's logprob and the top k (first: None)
    skip_special_tokens: bool = True  # the text leaves special tokens out
    spaces_between_special_tokens: bool = True  # False: no space a decoder puts before a special token's text
    # ---- structured outputs (issue #42): every output token keeps to this grammar (engine/core/structured.py) ----
    structured: StructuredOutput | None = None  # None: free text

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the parameter, so the API can answer 400 with `param` set. `vocab_size`
        bounds the token ids the logits controls name (None: unknown, only negative ids are refused)."""
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ParamError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ParamError("temperature", f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ParamError("top_k", f"top_k must be -1 (off) or positive, got {self.top_k}")
        if self.min_tokens < 0:
            raise ParamError("min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens", "min_tokens must not exceed max_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ParamError(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ParamError(
                "repetition_penalty", f"repetition_penalty must be positive and finite, got {self.repetition_penalty}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ParamError("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        self._validate_controls(vocab_size)

    def _validate_controls(self, vocab_size: int | None) -> None:
        """The issue #42 block, as vLLM's processor checks it: token ids must be in the vocabulary (when it is
        known), an allow-list must not be empty, bad words must be tokenized before the engine sees them."""
        if not 0 <= self.min_p <= 1:
            raise ParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ParamError(
                "prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if not all(math.isfinite(bias) for bias in self.logit_bias.values()):
            raise ParamError("logit_bias", "logit_bias values must be finite")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ParamError("allowed_token_ids", "allowed_token_ids must not be empty")
        if any(not word for word in self.bad_words):
            raise ParamError("bad_words", "bad_words must not contain an empty string")
        if self.bad_words and self.bad_words_token_ids is None:
            raise ParamError("bad_words", "bad_words were not tokenized (engine/frontend/bad_words.py)")
        for name, ids in (
            ("logit_bias", self.logit_bias),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("bad_words", [i for word in self.bad_words_token_ids or () for i in word]),
        ):
            bad = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
            if bad:
                raise ParamError(name, f"{name} has token id {bad[0]}, outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def constrained(self) -> bool:
        """True when a logits control (allow-list, bad words, bias) changes this request's logits."""
        return bool(self.allowed_token_ids is not None or self.bad_words_token_ids or self.logit_bias)

    @property
    def penalized(self) -> bool:
        """True when a penalty changes the logits, so the sampler keeps token counts for this request."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


class ParamError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
