"""The one place a request's token ids become what a client sees: text decoded incrementally (once per token,
UTF-8 safe), stop strings, the part of the text a stream may send, and logprobs with their token texts.

The offline `LLM` and the server's `AsyncEngine` both feed it each step's `EngineOutput`s once, right after
the step. A stop string finishes the request here, and `ProcessedOutputs.to_abort` names it so the caller
aborts it in the core before the next step: its KV is freed and no token is computed past the stop.

Text follows vLLM: the text is cut before the stop string (after it with include_stop_str_in_output); a stop
string completed by the last allowed token still reports "stop"; none is searched before min_tokens. While
a request runs, text that may be the start of a stop string is held back, so the deltas handed out always
concatenate to exactly the final text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.core.outputs import EngineOutput
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import TokenLogprob
from engine.frontend.stop_strings import StopStrings
from engine.model.tokenizer import IncrementalDetokenizer


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    """One token's logprobs with the texts the API shows: each token decoded alone, special tokens included, as
    vLLM writes them; and the ids behind them (for `return_tokens_as_token_ids` and prompt logprobs)."""

    token: str
    logprob: float | None  # of the chosen token; None for a prompt's first token (nothing comes before it)
    top: list[tuple[str, float]]  # the request's top k, best first
    token_id: int = -1
    top_ids: tuple[int, ...] = ()  # parallel to `top`
    rank: int | None = None  # the token's rank in the vocabulary (prompt logprobs)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step added to one request: the text now safe to send, the tokens it came from (usage counts
    them), their logprobs when asked for; `finish_reason` on the last one ("stop", "length", "abort",
    "error")."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[LogprobEntry] | None = None  # with the first token, where asked: each prompt token's


@dataclass(frozen=True)
class Resume:
    """A stream a replica that died had begun (engine/serving/ray_serve/resend.py): the tokens it produced, and
    how many characters of their text reached the client. The text goes on from there: what was held back
    (a possible stop string, an unfinished character) is still to come."""

    token_ids: tuple[int, ...]
    text_sent: int


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    to_abort: list[str] = field(default_factory=list)  # finished here by a stop string: abort them in the core


class _RequestText:
    """One request's text so far and how much of it was handed out."""

    def __init__(
        self, tokenizer: Any, params: SamplingParams, prompt_ids: Sequence[int], resume: Resume | None
    ) -> None:
        self._tokenizer = tokenizer
        self._detok = None
        if tokenizer is not None:
            spaces = params.spaces_between_special_tokens
            self._detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens, spaces, prompt_ids)
        self._stop = StopStrings(params.stop) if tokenizer is not None else StopStrings([])
        self._params = params
        self.num_tokens = 0
        self.sent = 0  # characters of the text handed out
        if resume is not None:
            self.num_tokens = len(resume.token_ids)
            if self._detok is not None:
                for token in resume.token_ids:
                    self._detok.add(token)
                self.sent = min(resume.text_sent, len(self._detok.text))

    def update(self, out: EngineOutput) -> tuple[str, str | None]:
        """Take the step's tokens; returns the text now safe to send and the finish reason, which a stop
        string sets to "stop" (it may end a request the core would have continued)."""
        reason, detok, params = out.finish_reason, self._detok, self._params
        self.num_tokens += len(out.new_token_ids)
        if detok is None:
            return "", reason
        new_from = len(detok.text)
        for token in out.new_token_ids:
            detok.add(token)
        text = detok.text
        found = None
        if self._stop and reason not in ("abort", "error") and self.num_tokens >= params.min_tokens:
            found = self._stop.find(text, new_from)
        if found is not None:
            start, stop = found
            end, reason = start + len(stop) if params.include_stop_str_in_output else start, "stop"
        elif reason is not None:
            detok.flush()  # the request ended: a trailing incomplete character is all there will be
            text = detok.text
            end = len(text)
        else:
            end = len(text) - self._stop.held_back(text, self.sent)
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent += len(delta)
        return delta, reason

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False) if self._tokenizer else ""

    def _entry(self, token_id: int, e: TokenLogprob) -> LogprobEntry:
        top = [(self._text(i), lp) for i, lp in e.top]
        return LogprobEntry(self._text(token_id), e.logprob, top, token_id, tuple(i for i, _ in e.top), e.rank)

    def logprobs(self, out: EngineOutput) -> list[LogprobEntry]:
        return [self._entry(t, e) for t, e in zip(out.new_token_ids, out.new_logprobs, strict=True)]

    def prompt_logprobs(self, out: EngineOutput) -> list[LogprobEntry]:
        """Each prompt token's entry (the first without a logprob). A backend that scores no prompt (the twin)
        leaves only the first, so the two lists may differ in length."""
        pairs = zip(out.prompt_token_ids, out.prompt_logprobs or [], strict=False)
        return [LogprobEntry(self._text(t), None, [], t) if e is None else self._entry(t, e) for t, e in pairs]


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        """`tokenizer` None (a backend without one): no text, no stop strings, tokens and logprobs only."""
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestText] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add_request(
        self, request_id: str, params: SamplingParams, prompt_ids: Sequence[int] = (), resume: Resume | None = None
    ) -> None:
        """After the core accepted the request; the text starts after `prompt_ids`, or goes on from `resume`."""
        self._requests[request_id] = _RequestText(self.tokenizer, params, prompt_ids, resume)

    def process(self, outputs: list[EngineOutput]) -> ProcessedOutputs:
        """Each request's message for this step; requests it finishes are forgotten."""
        done = ProcessedOutputs()
        for out in outputs:
            req = self._requests.get(out.request_id)
            if req is None:  # aborted here already
                continue
            text, reason = req.update(out)
            logprobs = req.logprobs(out) if out.new_logprobs else []
            prompt = req.prompt_logprobs(out) if out.prompt_logprobs is not None else None
            done.outputs.append(RequestOutput(out.request_id, text, out.new_token_ids, logprobs, reason, prompt))
            if reason is not None:
                del self._requests[out.request_id]
                if out.finish_reason is None:
                    done.to_abort.append(out.request_id)
        return done

    def abort(self, request_id: str) -> RequestOutput | None:
        """The caller aborts the request (client gone, drain): its last message, or None if unknown."""
        if self._requests.pop(request_id, None) is None:
            return None
        return RequestOutput(request_id, "", [], finish_reason="abort")
