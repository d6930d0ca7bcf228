"""Paged KV block accounting: a free list with exact used/free/total counts. The KV tensors themselves
belong to the backend; this is the bookkeeping the scheduler and telemetry share.

The pool is resizable (issue #15) in two steps, so that a backend that cannot resize leaves nothing
half-changed: `plan_resize` says what a resize would do, the backend moves its tensors to match, then
`apply` commits the plan here.

Shrinking compacts instead of stopping at the highest block in use: blocks in use above the new size
are moved into free blocks below it (`ResizePlan.moves`, old id -> new id; the backend copies their KV
and the engine rewrites the block tables). So a shrink always reaches max(target, blocks in use) and
gives back free blocks first: no sequence is preempted to shrink. Stopping at the highest block in use
would let one long-lived sequence at the top of the pool pin it at full size, which is exactly when
memory is tight. The cost is one block copy per moved block, at most the blocks in use.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ResizePlan:
    num_blocks: int  # the pool size after the resize
    old_num_blocks: int
    moves: dict[int, int] = field(default_factory=dict)  # in-use block id -> its new id (shrink only)

    @property
    def delta(self) -> int:
        return self.num_blocks - self.old_num_blocks


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.peak_blocks = num_blocks  # the largest the pool has been: what a benchmark point ran with
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV cache: asked for {n} blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        if len(self._free) > self.num_blocks:
            raise AssertionError("KV block freed twice")

    def plan_resize(self, target: int) -> ResizePlan:
        """What resizing to `target` blocks would do, changing nothing. A shrink never goes below the
        blocks in use (nor below one block); in-use blocks at or above the new size are moved to the
        lowest free ids below it."""
        if target >= self.num_blocks:
            return ResizePlan(target, self.num_blocks)
        size = max(target, self.num_used, 1)
        free = set(self._free)
        above = [b for b in range(size, self.num_blocks) if b not in free]
        holes = sorted(b for b in free if b < size)
        return ResizePlan(size, self.num_blocks, dict(zip(above, holes, strict=False)))

    def apply(self, plan: ResizePlan) -> None:
        """Commit a plan made by plan_resize on this allocator's current state."""
        if plan.old_num_blocks != self.num_blocks:
            raise ValueError(f"stale resize plan: made for {plan.old_num_blocks} blocks, pool has {self.num_blocks}")
        if plan.num_blocks >= self.num_blocks:
            self._free[:0] = range(plan.num_blocks - 1, self.num_blocks - 1, -1)  # new ids handed out last
        else:
            taken = set(plan.moves.values())
            self._free = sorted((b for b in self._free if b < plan.num_blocks and b not in taken), reverse=True)
        self.num_blocks = plan.num_blocks
        self.peak_blocks = max(self.peak_blocks, plan.num_blocks)
