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
    # Preempt by swapping the victim's KV blocks to host memory (and back when it is readmitted) instead of
    # recomputing them, where the backend can (Backend.swap). False: recompute (vLLM v1, the seed).
    preempt_by_swap: bool = False
    chunked_prefill: bool = True  # a prompt may be split across steps

    def as_dict(self) -> dict:
        """A shallow copy: called every step for the record, where dataclasses.asdict's deep copy shows."""
        return dict(self.__dict__)
