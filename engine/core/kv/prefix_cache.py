"""Automatic prefix caching, as vLLM v1 and SGLang have it: a request whose prompt starts with blocks another
request already computed reuses their KV instead of computing it again (a multi-turn chat resends the whole
conversation every turn; n > 1 choices and repeated prompts share one prompt).

Only full blocks are cached, each under a hash of (its parent block's hash, its token ids), so a hash names
the whole prefix up to the block's end and a hit on block i implies hits on blocks 0..i-1. Blocks are
registered once their KV is computed (`commit`, after a step or before blocks are freed); the allocator
(engine/core/kv/blocks.py) keeps them, reference-counted while tables hold them and on an LRU list once free.

The hash is SHA-256 over the parent's digest and the token ids as 64-bit integers, as vLLM hashes since
CVE-2025-25183: a block is shared between requests of different users, and Python's `hash` of a tuple is a
64-bit non-cryptographic hash whose collisions can be crafted, which would let one prompt read another's KV.
Digests are stable across processes, though nothing here needs that yet.
"""

from __future__ import annotations

import hashlib
from array import array

from engine.core.kv.blocks import BlockAllocator
from engine.core.sequence import Sequence

ROOT_HASH = hashlib.sha256(b"headroom prefix cache").digest()  # the parent of every sequence's first block


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class PrefixCache:
    """The scheduler's view of the cache: a sequence's hits at admission and its computed blocks after a
    step, and the hit counters in tokens (vLLM's prefix_cache_queries and prefix_cache_hits)."""

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.queries = 0  # tokens of the sequences admitted
        self.hits = 0  # of those, tokens whose KV came from the cache

    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks of `seq`'s longest cached prefix, changing nothing. At least one token is left
        to compute, as vLLM leaves it, so the step that computes it samples the next token."""
        usable = (seq.num_tokens - 1) // self.allocator.block_size
        return self.allocator.lookup(self._hashes(seq, usable)[:usable])

    def record_admission(self, seq: Sequence, hit_tokens: int) -> None:
        self.queries += seq.num_tokens
        self.hits += hit_tokens

    def commit(self, seq: Sequence) -> None:
        """Register `seq`'s blocks that became full and computed since the last commit."""
        full = seq.num_computed // self.allocator.block_size
        if full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_cached_blocks, full):
            self.allocator.cache(seq.block_table[i], hashes[i])
        seq.num_cached_blocks = full

    def _hashes(self, seq: Sequence, blocks: int) -> list[bytes]:
        """`seq.block_hashes` extended to at least `blocks` full blocks (or all its full blocks). Tokens are
        only ever appended, so hashes computed once stay valid, through preemption too."""
        hashes, bs = seq.block_hashes, self.allocator.block_size
        for i in range(len(hashes), min(blocks, seq.num_tokens // bs)):
            hashes.append(hash_block(hashes[-1] if hashes else ROOT_HASH, seq.token_slice(i * bs, (i + 1) * bs)))
        return hashes
