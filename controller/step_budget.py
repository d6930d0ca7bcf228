"""The one contract between the policy and the scheduler, for one step.

Before a step the policy publishes a `StepBudget`: its `Limits` and two pure fit functions (memory's answer to
"does this chunk, do these decodes, fit beside the step packed so far?"). They change nothing, so the scheduler
may call them any number of times. The scheduler packs the step through a `Packer`, which applies the liveness
rule and counts what memory cut; the counts leave the scheduler in its output as `MemoryCuts`, and the policy's
`observe(record, cuts)` reads them after the step. Nothing set while packing is read later through hidden state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from controller.limits import Limits
from telemetry.record import StepShape

# fit_chunk(shape, context, chunk): the largest prefill chunk (<= chunk) of a sequence with `context` tokens in KV
# that fits beside `shape`; 0 defers it. fit_decodes(shape, contexts): how many of these decodes (in order) fit.
ChunkFit = Callable[[StepShape, int, int], int]
DecodeFit = Callable[[StepShape, Sequence[int]], int]


def whole_chunk(shape: StepShape, context: int, chunk: int) -> int:
    """A policy without a memory model: every chunk the limits allow fits."""
    return chunk


def all_decodes(shape: StepShape, contexts: Sequence[int]) -> int:
    return len(contexts)


@dataclass(frozen=True)
class StepBudget:
    limits: Limits = field(default_factory=Limits)
    fit_chunk: ChunkFit = whole_chunk
    fit_decodes: DecodeFit = all_decodes
    # Liveness: a chunk cut to nothing on an empty step still runs this many tokens (or all it has), and an empty
    # step always takes one decode. Otherwise a model that over-predicts (a fresh plant, a reset) would defer
    # everything, no step would run, and nothing would ever correct it.
    min_chunk: int = 1


@dataclass(frozen=True)
class MemoryCuts:
    """What the fit functions cut while one step was packed."""

    chunks: int = 0  # prefill chunks memory cut short
    deferred_prefills: int = 0  # prefill candidates memory deferred to a later step
    deferred_decodes: int = 0  # decode candidates memory deferred
    cut: bool = False  # memory limited the step (a chunk or a decode cut, even one liveness let through)

    @property
    def deferred(self) -> int:
        return self.deferred_prefills + self.deferred_decodes


NO_CUTS = MemoryCuts()


def is_empty(shape: StepShape) -> bool:
    return shape.prefill_tokens == 0 and shape.decode_seqs == 0


class Packer:
    """One step's packing under a budget: the fit functions, the liveness rule, and the count of what memory cut
    (`cuts()` when the step is packed). Made fresh by the scheduler for every step."""

    __slots__ = ("budget", "chunks", "deferred_prefills", "deferred_decodes", "cut")

    def __init__(self, budget: StepBudget) -> None:
        self.budget = budget
        self.chunks = self.deferred_prefills = self.deferred_decodes = 0
        self.cut = False

    def chunk(self, shape: StepShape, context: int, chunk: int) -> int:
        c = self.budget.fit_chunk(shape, context, chunk)
        if c >= chunk:
            return chunk
        if is_empty(shape):
            c = max(c, min(chunk, self.budget.min_chunk))
        self.cut = True
        if c:
            self.chunks += 1
        else:
            self.deferred_prefills += 1
        return c

    def decodes(self, shape: StepShape, contexts: Sequence[int]) -> int:
        n = self.budget.fit_decodes(shape, contexts)
        if n >= len(contexts):
            return len(contexts)
        if n == 0 and is_empty(shape):
            return 1
        self.cut = True
        self.deferred_decodes += len(contexts) - n
        return n

    def cuts(self) -> MemoryCuts:
        if not self.cut:
            return NO_CUTS
        return MemoryCuts(self.chunks, self.deferred_prefills, self.deferred_decodes, True)
