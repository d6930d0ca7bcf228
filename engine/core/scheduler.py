"""Continuous batching over a waiting and a running queue, under the policy's StepBudget each step.

schedule() takes the budget the policy publishes, packs the step through a Packer (the budget's fit functions,
the liveness rule, the count of what memory cut) and returns a SchedulerOutput: plain data for the backend, and
the cuts for the policy's observe(). KV blocks are taken only through BlockAllocator.allocate_slots.

The rules here are the production engine's. A baseline that replays another engine (engine/baselines/) overrides
the hooks: the step's fill order (`_fill`), which running sequences may decode (`_decodable`), which prompt
must wait (`_prefill_waits`), the output a reservation adds (`_future_tokens`) and the preemption victim
(`_victim`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import islice

from controller.limits import Limits
from controller.policy import Policy
from controller.step_budget import Packer
from engine.core.batch import ModelOutput, ScheduledItem, SchedulerOutput
from engine.core.kv.blocks import BlockAllocator
from engine.core.kv.prefix_cache import PrefixCache
from engine.core.sequence import Sequence, Status


class Scheduler:
    def __init__(
        self, allocator: BlockAllocator, policy: Policy, prefix_cache: PrefixCache | None = None, can_swap: bool = False
    ) -> None:
        self.allocator = allocator
        self.policy = policy
        self.prefix_cache = prefix_cache  # None: prefix caching off
        self.can_swap = can_swap  # the backend can copy KV blocks to host memory and back (Backend.swap)
        self._swap = False  # this step preempts by swap (the policy asks for it and the backend can)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self._finished: list[str] = []  # requests finished since the last output
        self.requests: dict[str, Sequence] = {}  # every unfinished request, by id (outputs name them by id)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.requests[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.policy.step_budget()
        lim = budget.limits
        self._swap = lim.preempt_by_swap and self.can_swap
        out = SchedulerOutput()
        packer = Packer(budget)
        self._fill(lim, packer, out)
        while not out.items and out.kv_blocked and len(self.running) > 1:
            # Running prefills hold every block and none can grow: recompute the newest later.
            self._preempt(self.running[-1], out)
            self._fill(lim, packer, out)
        out.cuts = packer.cuts()
        if out.items:  # only an output with items reaches the backend (Backend.execute)
            out.finished, self._finished = self._finished, []
        return out

    def _fill(self, lim: Limits, packer: Packer, out: SchedulerOutput) -> None:
        """Decodes first, prompt chunks in the room left (vLLM v1's order)."""
        self._schedule_decodes(lim, packer, out)
        self._schedule_prefills(lim, packer, out)

    def _decodable(self, lim: Limits, out: SchedulerOutput, scheduled: set[str]) -> Iterator[Sequence]:
        """Running sequences that may decode this step, in admission order."""
        return (s for s in self.running if s.status is Status.RUNNING and s.is_decode and s.request_id not in scheduled)

    def _schedule_decodes(self, lim: Limits, packer: Packer, out: SchedulerOutput) -> None:
        scheduled = {it.request_id for it in out.items}
        # max_decode_seqs and the whole-step token budget (one token per decode).
        room = min(lim.max_decode_seqs - out.shape.decode_seqs, lim.max_batched_tokens - out.shape.tokens)
        candidates = list(islice(self._decodable(lim, out, scheduled), max(0, room)))
        # the policy's memory check, once for the whole prefix
        fit = packer.decodes(out.shape, [s.num_tokens for s in candidates])
        for seq in candidates[:fit]:
            if seq.status is not Status.RUNNING or not self._grow_for_decode(seq, scheduled, out):
                continue  # preempted to grow an earlier candidate, or for its own slot
            scheduled.add(seq.request_id)
            out.add(ScheduledItem.of(seq, seq.num_computed, 1, is_prefill=False))

    def _grow_for_decode(self, seq: Sequence, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Give `seq` a KV slot for its next token, preempting unscheduled running sequences by recompute
        when the pool is empty. Returns False if `seq` itself was preempted."""
        while self.allocator.allocate_slots(seq, 1) is None:
            victim = self._victim([s for s in reversed(self.running) if s.request_id not in scheduled])
            if victim is None:
                return False
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _victim(self, unscheduled: list[Sequence]) -> Sequence | None:
        """Of the unscheduled running sequences (newest first), the one closest to its max_tokens (the newest
        among ties): it holds the most blocks, so fewer sequences are evicted, and it owes the fewest decode
        steps after it is readmitted, so the wait does not lengthen the longest remaining request (the
        makespan). vLLM evicts the newest instead; the comparison is in bench/results/controller_notes.md."""
        return min(unscheduled, key=lambda s: s.remaining_new_tokens, default=None)

    def blocks_owed(self) -> int:
        """Blocks the queued work needs for the tokens it already has: the rest of each running sequence's
        known tokens (a chunked prefill or recompute in progress, the next decode's slot) and each waiting
        sequence's prompt (and output, when preempted). Free blocks beyond these are spare."""
        blocks_for = self.allocator.blocks_for
        running = sum(max(0, blocks_for(s.num_tokens) - len(s.block_table)) for s in self.running)
        return running + sum(blocks_for(s.num_tokens) for s in self.waiting)

    def preempt_newest(self, max_used: int) -> list[Sequence]:
        """Preempt running sequences by recompute, newest first, until at most `max_used` blocks are in use;
        returns them. The last resort of a KV pool that must shrink below the blocks in use (between steps,
        so no batch holds them)."""
        victims = []
        while self.allocator.num_used > max_used and self.running:
            victims.append(self.running[-1])
            self._release(self.running[-1])
        return victims

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """By swap when this step may (its KV goes to host memory before the step runs, and comes back when it
        is readmitted, instead of being recomputed), else by recompute."""
        if self._swap and seq.num_computed > 0:
            out.swap_out.append((seq.request_id, seq.block_table[: self.allocator.blocks_for(seq.num_computed)]))
            seq.swapped_tokens = seq.num_computed
        self._release(seq)
        out.preempted.append(seq.request_id)

    def _release(self, seq: Sequence) -> None:
        """Back to the head of the queue with its blocks freed: its tokens are recomputed when readmitted
        (those still cached when it is, taken from the cache), unless it was swapped out (`swapped_tokens`)."""
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _free_blocks(self, seq: Sequence) -> None:
        """Free `seq`'s blocks, registering its computed full blocks first (a decode burst that bypassed
        `update` may have filled some), so they stay cached for a later request or its own readmission."""
        if self.prefix_cache is not None:
            self.prefix_cache.commit(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_cached_blocks = 0

    @property
    def reserve_slack(self) -> int:
        """Token slots a reservation holds beyond a request's prompt and output (none under the production
        rules): a request whose tokens and these exceed the whole pool could never be admitted."""
        return 0

    def _future_tokens(self, seq: Sequence, lim: Limits) -> int:
        """Output tokens a reservation holds blocks for: `kv_reserve_ratio` of what `seq` may still emit."""
        return int(lim.kv_reserve_ratio * seq.remaining_new_tokens + 0.999999)

    def _reserved_blocks(self, seq: Sequence, lim: Limits) -> int:
        """Blocks `seq` may still claim: the rest of its known tokens plus its reserved output."""
        return max(0, self.allocator.blocks_for(seq.num_tokens + self._future_tokens(seq, lim)) - len(seq.block_table))

    def _prefill_waits(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Whether `seq`'s prompt must wait this step while later ones may go (the production rules: never)."""
        return False

    def _schedule_prefills(self, lim: Limits, packer: Packer, out: SchedulerOutput) -> None:
        queue = [s for s in self.running if not s.is_decode] + list(self.waiting)  # chunked prefills first
        if not queue:
            return
        outstanding = sum(self._reserved_blocks(s, lim) for s in self.running)
        alloc = self.allocator
        for seq in queue:
            admitting = seq.status is Status.WAITING
            if out.shape.prefill_seqs >= lim.max_prefill_seqs:
                break
            if admitting and len(self.running) >= lim.max_num_seqs:
                break
            if self._prefill_waits(seq, out):
                continue
            # Prefix cache hits (admission only; a swapped-out sequence's KV comes back from host memory).
            swapped = admitting and seq.swapped_tokens > 0
            cached = admitting and not swapped and self.prefix_cache is not None
            hits = self.prefix_cache.match(seq) if cached else []  # type: ignore[union-attr]
            free = alloc.num_free - alloc.num_evictable(hits)  # what is free once they are taken
            budget = min(lim.max_prefill_tokens - out.shape.prefill_tokens, lim.max_batched_tokens - out.shape.tokens)
            # KV admission: a new sequence must fit beside every running one's outstanding reservation.
            need = self._reserved_blocks(seq, lim) - len(hits) if admitting else 0
            if admitting and need > free - outstanding:
                out.kv_blocked = True
                break
            if swapped:  # no prefill: its KV comes back from host memory
                outstanding += need - self._swap_in(seq, out)
                if seq.is_decode:
                    if packer.decodes(out.shape, [seq.num_tokens]):  # its next token, this step
                        out.add(ScheduledItem.of(seq, seq.num_computed, 1, is_prefill=False))
                    continue
                admitting, need, free = False, 0, alloc.num_free  # part way through its prompt
            start = seq.num_computed + len(hits) * alloc.block_size
            remaining = seq.num_tokens - start
            # KV room: the chunk is cut to the tokens its last block and the free blocks hold. Both KV
            # checks come before the memory fit, so the policy only ever counts chunks that run.
            kv_room = (len(seq.block_table) + len(hits) + free) * alloc.block_size - start
            chunk = min(remaining, budget, kv_room)
            if kv_room < budget and kv_room < remaining:
                out.kv_blocked = True
            if (chunk < remaining and not lim.chunked_prefill) or kv_room <= 0:
                break
            if chunk > 0:
                chunk = packer.chunk(out.shape, start, chunk)
            if chunk <= 0:
                out.deferred += 1
                break
            grown = alloc.allocate_slots(seq, chunk, hits)  # kv_room holds the chunk: never None
            if admitting:
                self._admit(seq, len(hits), out)
            outstanding += need - len(grown or ())
            out.chunked += chunk < remaining
            out.add(ScheduledItem.of(seq, seq.num_computed, chunk, is_prefill=True))

    def _admit(self, seq: Sequence, hits: int, out: SchedulerOutput) -> None:
        """Waiting to running, its first `hits` blocks (already in its table) from the prefix cache."""
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        if self.prefix_cache is None:
            return
        seq.num_cached_blocks = hits
        seq.num_computed = hits * self.allocator.block_size
        self.prefix_cache.record_admission(seq, seq.num_computed)
        out.prefix_queries += seq.num_tokens
        out.prefix_hits += seq.num_computed

    def _swap_in(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Readmit a swapped-out sequence: blocks for its tokens (the first filled from its host copy before
        the step runs, the last holding its next token's slot). Returns the blocks taken."""
        if self.allocator.allocate_slots(seq, seq.num_tokens) is None:
            raise MemoryError("KV cache: no room to swap a sequence back in past its admission check")
        blocks = seq.block_table[: self.allocator.blocks_for(seq.swapped_tokens)]
        seq.num_computed, seq.swapped_tokens = seq.swapped_tokens, 0
        out.swap_in.append((seq.request_id, blocks))
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        return len(seq.block_table)

    def update(self, out: SchedulerOutput, model_output: ModelOutput) -> list[tuple[Sequence, ScheduledItem]]:
        """Advance every scheduled sequence past the tokens it computed and append the sampled tokens; returns
        each scheduled sequence with its item, in item order."""
        sampled = iter(model_output.sampled)
        advanced = []
        for item in out.items:
            seq = self.requests[item.request_id]
            seq.num_computed = item.start + item.num_tokens
            if self.prefix_cache is not None:
                self.prefix_cache.commit(seq)
            if item.sample:
                seq.output_ids.append(next(sampled))
            advanced.append((seq, item))
        return advanced

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self._free_blocks(seq)
        seq.swapped_tokens = 0
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        del self.requests[seq.request_id]
        self._finished.append(seq.request_id)
