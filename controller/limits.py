"""The limits a policy hands the scheduler each step. Each field says where the scheduler enforces it."""

from __future__ import annotations

from dataclasses import dataclass

UNLIMITED = 1 << 30


@dataclass(frozen=True)
class Limits:
    # Prefill budget: new prompt tokens one step may compute. Prompts longer than what is left are
    # chunked to fit (if chunking is allowed) or wait for the next step.
    max_prefill_tokens: int = UNLIMITED
    max_prefill_seqs: int = UNLIMITED  # prompts (or prompt chunks) in one step
    max_decode_seqs: int = UNLIMITED  # running sequences decoded in one step
    max_num_seqs: int = UNLIMITED  # global cap on admitted (running) sequences
    # Whole-step token budget, decodes included (vLLM's max_num_batched_tokens).
    max_batched_tokens: int = UNLIMITED
    # Fraction of each request's not-yet-generated max_tokens reserved in KV blocks when it is admitted.
    # 1.0 is whole-request reservation (no preemption ever needed); 0.0 reserves the prompt only and
    # relies on preemption by recompute when decode runs out of blocks.
    kv_reserve_ratio: float = 0.0
    # Token slots reserved at admission beyond the request's tokens and that share of its output. The seed
    # engine sizes a request as floor(tokens / block) + 1 blocks, i.e. one slot more than it can write.
    kv_reserve_extra_tokens: int = 0
    # Preempt by swapping the victim's KV blocks to host memory (and back when it is readmitted) instead of
    # recomputing them, where the backend can (Backend.swap). False: recompute (vLLM v1, the seed).
    preempt_by_swap: bool = False
    # The victim when a decode finds no free block: False, the running sequence closest to its max_tokens
    # (engine/core/scheduler.py says why); True, the newest admitted one (vLLM v1's `running.pop()`).
    preempt_newest: bool = False
    allow_mixed: bool = True  # prefill and decode may share a step
    prefill_first: bool = False  # when a prefill can be scheduled, the step is prefill-only (seed engine)
    chunked_prefill: bool = True  # a prompt may be split across steps
    # Long-prompt rules of the seed engine: prompts of at least `long_prompt_threshold` tokens are at most
    # `max_long_per_batch` per step, and wait while any decode runs if `defer_long_while_decoding`.
    long_prompt_threshold: int = UNLIMITED
    max_long_per_batch: int = UNLIMITED
    defer_long_while_decoding: bool = False

    def as_dict(self) -> dict:
        """A shallow copy: called every step for the record, where dataclasses.asdict's deep copy shows."""
        return dict(self.__dict__)
