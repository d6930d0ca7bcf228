"""Paged KV block accounting: a free list with exact used/free/total counts. The KV tensors themselves
belong to the backend; this is the bookkeeping the scheduler and telemetry share.

The pool is resizable in two steps, so that a backend that cannot resize leaves nothing
half-changed: `plan_resize` says what a resize would do, the backend moves its tensors to match, then
`apply` commits the plan here.

Shrinking compacts instead of stopping at the highest block in use: blocks in use above the new size
are moved into free blocks below it (`ResizePlan.moves`, old id -> new id; the backend copies their KV
and the engine rewrites the block tables). So a shrink always reaches max(target, blocks in use) and
gives back free blocks first: no sequence is preempted to shrink. Stopping at the highest block in use
would let one long-lived sequence at the top of the pool pin it at full size, which is exactly when
memory is tight. The cost is one block copy per moved block, at most the blocks in use.

Prefix caching (engine/core/kv/prefix_cache.py) adds three things here, because eviction and resizing must change
them together with the free list: a reference count per block (sequences with the same prefix share its
blocks), a hash index (full computed blocks, hash <-> block), and an LRU list of evictable blocks (free,
but still holding a cached prefix). Evictable blocks count as free: `num_free` is what a new allocation
can get, and `allocate` takes never-cached free blocks first, then evicts the least recently used cached
block (dropping its hash). Without prefix caching no block is ever hashed, so the evictable list stays
empty and the allocator behaves exactly as a plain free list.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.sequence import Sequence


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
        self._free = list(range(num_blocks - 1, -1, -1))  # free and never cached; pop() hands out low ids first
        self._refs = [0] * num_blocks  # block tables holding each block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free cached blocks, least recently used first
        self._hash_of: dict[int, bytes] = {}  # cached block -> its prefix hash
        self._block_of: dict[bytes, int] = {}  # prefix hash -> the cached block holding it

    @property
    def num_free(self) -> int:
        """Blocks an allocation can get now: never-cached free blocks and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached prefix, in use or evictable."""
        return len(self._block_of)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"KV cache: asked for {n} blocks, {self.num_free} free")
        blocks = [self._take_free() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> list[int] | None:
        """The one way the scheduler takes KV blocks (vLLM's allocate_slots): room in `seq`'s block table for
        `num_new_tokens` more tokens past its computed ones. `hits`, at admission, are the cached blocks of its
        prefix (PrefixCache.match): they are shared and head its table, and their tokens count as computed.
        Returns the blocks newly allocated, appended to the table; None, and nothing changed, when the free
        blocks do not hold them."""
        hits = hits or []
        end = seq.num_computed + len(hits) * self.block_size + num_new_tokens
        need = max(0, self.blocks_for(end) - len(seq.block_table) - len(hits))
        if not need and not hits:  # most decodes: the slot is in the table's last block
            return []
        if need > self.num_free - self.num_evictable(hits):
            return None
        if hits:
            self.share(hits)
            seq.block_table.extend(hits)
        blocks = self.allocate(need)
        seq.block_table.extend(blocks)
        return blocks

    def _take_free(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._evictable.popitem(last=False)
        self._forget(block)
        return block

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. A block no table holds goes back to the free list, or, when it
        holds a cached prefix, to the most recent end of the evictable list: the table's last block is
        appended first, so it is evicted before the prefix blocks that more requests share."""
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise AssertionError("KV block freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def cache(self, block: int, block_hash: bytes) -> None:
        """Register a full block whose KV is computed under its prefix hash. A hash some other block already
        holds (two requests computed the same prefix at once) keeps that block; this one stays uncached."""
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The cached blocks of the longest run of `hashes` from the first, changing nothing."""
        blocks = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of `blocks` are free (evictable) now: what sharing them takes from `num_free`."""
        return sum(self._refs[b] == 0 for b in blocks)

    def share(self, blocks: list[int]) -> None:
        """Add a reference to each of these cached blocks (from `lookup`), taking evictable ones off the list."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1

    def _forget(self, block: int) -> None:
        del self._block_of[self._hash_of.pop(block)]

    def plan_resize(self, target: int) -> ResizePlan:
        """What resizing to `target` blocks would do, changing nothing. A shrink never goes below the
        blocks in use (nor below one block); in-use blocks at or above the new size are moved into free
        blocks below it: the lowest never-cached ids first, then evictable ones, least recently used first.
        Evictable blocks above the new size, or moved into, are evicted."""
        if target >= self.num_blocks:
            return ResizePlan(target, self.num_blocks)
        size = max(target, self.num_used, 1)
        above = [b for b in range(size, self.num_blocks) if self._refs[b] > 0]
        holes = sorted(b for b in self._free if b < size) + [b for b in self._evictable if b < size]
        return ResizePlan(size, self.num_blocks, dict(zip(above, holes, strict=False)))

    def apply(self, plan: ResizePlan) -> None:
        """Commit a plan made by plan_resize on this allocator's current state. A moved block keeps its
        references and its hash, under its new id."""
        if plan.old_num_blocks != self.num_blocks:
            raise ValueError(f"stale resize plan: made for {plan.old_num_blocks} blocks, pool has {self.num_blocks}")
        if plan.num_blocks >= self.num_blocks:
            self._free[:0] = range(plan.num_blocks - 1, self.num_blocks - 1, -1)  # new ids handed out last
            self._refs.extend([0] * plan.delta)
        else:
            taken = set(plan.moves.values())
            self._free = sorted((b for b in self._free if b < plan.num_blocks and b not in taken), reverse=True)
            for b in [b for b in self._evictable if b >= plan.num_blocks or b in taken]:
                del self._evictable[b]
                self._forget(b)
            for old, new in plan.moves.items():
                self._refs[new] = self._refs[old]
                if (h := self._hash_of.pop(old, None)) is not None:
                    self._hash_of[new] = h
                    self._block_of[h] = new
            del self._refs[plan.num_blocks :]
        self.num_blocks = plan.num_blocks
        self.peak_blocks = max(self.peak_blocks, plan.num_blocks)
