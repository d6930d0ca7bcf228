"""What the scheduler hands the backend for one step, and what the backend hands back: plain data.

The scheduler's output names each request by id and carries what the backend reads for it (the step's token
ids, positions, block table, sampling parameters); the backend never sees a Sequence and never writes into the
output. It returns a ModelOutput. State a backend keeps per request (host copies of swapped-out KV, the sampler's
penalty counts) is keyed by request id and dropped when an output lists the request in `finished`.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import NamedTuple

from controller.step_budget import NO_CUTS, MemoryCuts
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence, TokenLogprob
from telemetry.record import StepShape


class ScheduledItem(NamedTuple):
    """One request's work in a step (a NamedTuple: immutable, and made for every item of every step)."""

    request_id: str
    token_ids: Seq[int]  # the tokens computed this step, at positions start .. start + num_tokens - 1
    start: int  # first position computed this step
    num_tokens: int  # tokens computed this step (1 for a decode)
    is_prefill: bool
    sample: bool  # this chunk reaches the end of the known tokens: a token is sampled for it
    # The sequence's KV blocks, enough for start + num_tokens tokens: the scheduler's list, read only, valid for
    # this step (a copy per item per step would cost O(context)).
    block_table: list[int]
    params: SamplingParams
    prompt_ids: tuple[int, ...]  # the request's prompt (the same tuple every step): penalties start from it
    max_tokens: int

    @property
    def num_output(self) -> int:
        """Output tokens before the one this item samples."""
        return self.start + self.num_tokens - len(self.prompt_ids)

    @property
    def prompt_logprob_positions(self) -> range:
        """The positions computed this step whose next token is a prompt token, where the request asks for
        prompt logprobs: their logits score the prompt (vLLM's prompt_logprobs). Empty for everything else."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(self.start, min(self.start + self.num_tokens, len(self.prompt_ids) - 1))

    @classmethod
    def of(cls, seq: Sequence, start: int, num_tokens: int, is_prefill: bool) -> ScheduledItem:
        """The item that computes `num_tokens` of `seq` from `start`."""
        end = start + num_tokens
        return cls(
            seq.request_id,
            seq.token_slice(start, end),
            start,
            num_tokens,
            is_prefill,
            end == seq.num_tokens,
            seq.block_table,
            seq.params,
            seq.prompt_ids,
            seq.max_tokens,
        )


@dataclass
class SchedulerOutput:
    items: list[ScheduledItem] = field(default_factory=list)
    shape: StepShape = field(default_factory=StepShape)
    preempted: list[str] = field(default_factory=list)  # request ids preempted while packing this step
    # Preemption by swap: (request id, device blocks) to copy to host memory, then (request id, device blocks) to
    # copy its host copy back into; the backend runs both, in that order, before the step (Backend.swap).
    swap_out: list[tuple[str, list[int]]] = field(default_factory=list)
    swap_in: list[tuple[str, list[int]]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # requests that left since the last output: drop their state
    cuts: MemoryCuts = NO_CUTS  # what the budget's fit functions cut (controller/step_budget.py)
    deferred: int = 0  # prefill candidates the fit check pushed to a later step
    chunked: int = 0  # prefills cut short of the sequence's remaining tokens
    kv_blocked: bool = False  # a prefill waited for KV blocks
    prefix_queries: int = 0  # tokens of the sequences admitted this step (prefix caching on)
    prefix_hits: int = 0  # of those, tokens whose KV came from the prefix cache

    def add(self, item: ScheduledItem) -> None:
        self.items.append(item)
        s, ctx = self.shape, item.start + item.num_tokens
        if item.is_prefill:
            s.prefill_tokens += item.num_tokens
            s.prefill_seqs += 1
            s.prefill_attn += item.num_tokens * ctx
        else:
            s.decode_seqs += 1
        s.sum_context += ctx
        s.max_context = max(s.max_context, ctx)
        s.sampled_seqs += item.sample


@dataclass(frozen=True, slots=True)
class ModelOutput:
    """One step's results: a sampled token id per item with `sample`, in item order, and for each such item its
    TokenLogprob where its request asks for logprobs (None otherwise; an empty list when none asked).
    `prompt_logprobs`, by request id: the TokenLogprobs of the prompt tokens that follow the item's
    `prompt_logprob_positions`, in order."""

    sampled: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # structured outputs: the requests whose grammar this step's token completed; the engine ends them ("stop")
    structured_done: frozenset[str] = frozenset()


EMPTY = ModelOutput()
