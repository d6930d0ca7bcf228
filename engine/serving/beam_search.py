"""vLLM's beam search (`use_beam_search`), as its OpenAI server runs it: above the engine, one token at a time.

Each step sends every live beam to the engine as its own one-token request (prompt + the beam's tokens) with
2 * width logprobs, the candidates vLLM takes, as Hugging Face's beam search does; prefix caching keeps
the repeated prefixes cheap. A candidate that is EOS (unless `ignore_eos`) completes its beam; the others are
ranked by vLLM's score, the cumulative logprob over the whole sequence's length (prompt included, a final EOS
not) to the power `length_penalty`, and the best `width` go on. After `max_tokens` steps the best `width` of
the completed and the live beams are the answer's choices, best first. Like vLLM's, it is not streamed, and
the logprobs are the raw model's (before the temperature, which only changes the sampled extra candidate).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from engine.core.sampling_params import SamplingParams
from engine.serving import protocol as p
from engine.serving.async_engine import AsyncEngine
from engine.serving.choices import ChoiceUpdates, submit
from engine.serving.errors import bad_request
from engine.serving.messages import LogprobEntry


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)  # the output so far (a completing EOS kept only on request)
    logprobs: list[LogprobEntry] = field(default_factory=list)  # each output token's, with its step's top
    cum_logprob: float = 0.0
    finish_reason: str = "length"


@dataclass(frozen=True)
class BeamSearch:
    width: int
    max_tokens: int
    temperature: float
    length_penalty: float
    ignore_eos: bool
    include_stop_str_in_output: bool
    eos_token_ids: frozenset[int]

    def score(self, beam: Beam, prompt_len: int) -> float:
        """vLLM's get_beam_search_score: a final EOS does not count in the length."""
        n = prompt_len + len(beam.tokens) - bool(beam.tokens and beam.tokens[-1] in self.eos_token_ids)
        return beam.cum_logprob / n**self.length_penalty

    async def run(self, engine: AsyncEngine, prompt: list[int], gone: Callable[[], Awaitable[bool]]) -> list[Beam]:
        """The best `width` beams, best first; stops early (with what it has) once `gone()` says the client
        left."""
        step = SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=2 * self.width)
        live, done = [Beam()], []
        for _ in range(self.max_tokens):
            if not live or await gone():
                break
            grown = []
            for beam, entry in zip(live, await self._step(engine, prompt, live, step), strict=True):
                for candidate in _candidates(entry):
                    child = Beam([*beam.tokens, candidate.token_id], [*beam.logprobs, candidate])
                    child.cum_logprob = beam.cum_logprob + (candidate.logprob or 0.0)
                    if candidate.token_id in self.eos_token_ids and not self.ignore_eos:
                        child.finish_reason = "stop"
                        if not self.include_stop_str_in_output:
                            child.tokens.pop()
                        done.append(child)
                    else:
                        grown.append(child)
            live = sorted(grown, key=lambda b: self.score(b, len(prompt)), reverse=True)[: self.width]
        return sorted([*done, *live], key=lambda b: self.score(b, len(prompt)), reverse=True)[: self.width]

    @staticmethod
    async def _step(
        engine: AsyncEngine, prompt: list[int], live: list[Beam], step: SamplingParams
    ) -> list[LogprobEntry]:
        """Each live beam's next-token entry: its sampled token with the top 2 * width."""
        choices = await submit(engine, [([*prompt, *beam.tokens], step) for beam in live])
        updates = ChoiceUpdates(choices)
        try:
            async for choice, update in updates:
                choice.advance(update)
        finally:
            updates.close()
        return [choice.logprobs[0] for choice in choices]


def _candidates(entry: LogprobEntry) -> list[LogprobEntry]:
    """A step's candidates, as vLLM takes them: the sampled token and the top 2 * width, each as the entry its
    beam shows (that token's logprob, the step's top)."""
    scored = {entry.token_id: (entry.token, entry.logprob)}
    scored.update(zip(entry.top_ids, entry.top, strict=True))
    return [replace(entry, token=text, logprob=lp, token_id=token) for token, (text, lp) in scored.items()]


@dataclass(frozen=True)
class Found:
    """One beam as an answer shows it: its text (a final EOS left out), its logprobs with the answer's top k."""

    text: str
    logprobs: list[LogprobEntry]
    finish_reason: str
    token_ids: list[int]  # every token the beam made (usage counts them)


async def search(
    engine: AsyncEngine,
    tokenizer: Any,
    req: p.SamplingFields,
    prompts: list[list[int]],
    max_tokens: int | None,
    top: int,
    gone: Callable[[], Awaitable[bool]],
) -> list[list[Found]]:
    """Each prompt's best `n` beams, searched at once. max_tokens None: up to the context, as vLLM's; a
    prompt and max_tokens past it is a 400, as for a sampled answer."""
    context = engine.info.max_model_len
    eos = frozenset(tokenizer.eos_token_ids)
    temperature = 1.0 if req.temperature is None else req.temperature

    async def one(prompt: list[int]) -> list[Found]:
        limit = context - len(prompt)
        if max_tokens is not None and max_tokens > limit:
            message = f"prompt plus max_tokens exceeds the model's context ({context} tokens)"
            raise bad_request(message, "max_tokens", "context_length_exceeded")
        beams = BeamSearch(req.n, max_tokens or limit, temperature, req.length_penalty, req.ignore_eos,
                           req.include_stop_str_in_output, eos)  # fmt: skip
        found = []
        for b in await beams.run(engine, prompt, gone):
            shown = b.tokens[:-1] if b.tokens and b.tokens[-1] in eos and not req.ignore_eos else b.tokens
            text = tokenizer.decode(shown, skip_special_tokens=req.skip_special_tokens)
            entries = [replace(e, top=e.top[:top], top_ids=e.top_ids[:top]) for e in b.logprobs]
            found.append(Found(text, entries, b.finish_reason, list(b.tokens)))
        return found

    return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))
