"""Per-request sampling parameters, with vLLM's SamplingParams names."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # vLLM's default max_logprobs, OpenAI's top_logprobs limit


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

    def validate(self) -> None:
        """Raise ValueError naming the parameter, so the API can answer 400 with `param` set."""
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """True when a penalty changes the logits, so the sampler keeps token counts for this request."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


class ParamError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
