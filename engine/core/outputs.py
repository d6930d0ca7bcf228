"""What one engine step hands the front end: data only, token ids and token-level finish reasons, no text."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.sequence import TokenLogprob


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """One request's new tokens this step. `finish_reason` ("stop" for EOS or a stop token id, "length",
    "abort", "error") is set on the request's last output; text and stop strings are the front end's."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # parallel to new_token_ids when asked for
    finish_reason: str | None = None
    # with the first token of a request that asks for them: every prompt token's logprobs (the first None),
    # and the prompt's ids they score
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: tuple[int, ...] = ()
