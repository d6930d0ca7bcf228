"""PyTorch's CUDA caching allocator as the twin models it (engine/backends/twin/memory.py replays each step's
allocations through it).

Why an allocator model and not a formula: what kills a step is not the bytes it needs but whether
cudaMalloc can still find them. The allocator keeps freed segments cached (reserved > allocated), reuses
them best-fit, splits them, and only returns them to the driver when a cudaMalloc fails (flush, then one
retry). A tensor that outlives its step pins its segment, so the same step can pass on a clean cache and
fail after a different shape ran before it.
"""

from __future__ import annotations

from telemetry.units import MIB

SMALL_SIZE = 1 << 20  # allocations up to 1 MiB come from the small pool (2 MiB segments)
SMALL_SEGMENT = 2 << 20
MIN_LARGE_ALLOC = 10 << 20  # below this a large allocation gets a 20 MiB segment
LARGE_SEGMENT = 20 << 20
ROUND_LARGE = 2 << 20


def block_round(size: int) -> int:
    """A block's size in the caching allocator: requests round up to 512 B."""
    return -(-size // 512) * 512


def segment_size(size: int) -> int:
    """cudaMalloc size for a large-pool request (CUDACachingAllocator's get_allocation_size)."""
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def _index(seg: list[list], block: list) -> int:
    """Position of `block` in its segment by identity (equal-valued free blocks are distinct blocks)."""
    return next(i for i, b in enumerate(seg) if b is block)


class DeviceOOM(Exception):
    """cudaMalloc failed after the cache flush; the backend turns it into torch.OutOfMemoryError."""


class CachingAllocator:
    """The large pool of CUDACachingAllocator, reduced to what decides OOM: segments made of contiguous
    blocks, best-fit reuse (smallest block, then oldest segment), split when more than 1 MiB is left,
    merge of free neighbours, and on a failed cudaMalloc a flush of every wholly free segment and one retry.
    Small-pool requests (<= 1 MiB) are counted, not placed: they live in 2 MiB segments of their own and
    cannot fragment the large pool.

    `limit` is what the driver can still give this allocator (device total minus everything else). A block
    is [size, tag]; tag None means free. The state between steps is hashable (`key`), so the backend can
    memoize whole steps.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.segments: list[list[list]] = []  # each segment: blocks in address order
        self.small_reserved = 0
        self.allocated = 0
        self.small_live = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.retries = 0
        self._where: dict[object, tuple[list[list], list]] = {}

    # -- state -----------------------------------------------------------------------------------
    @property
    def reserved(self) -> int:
        return sum(b[0] for s in self.segments for b in s) + self.small_reserved

    def key(self) -> tuple:
        """(large segments, small-pool reserved, live small blocks, allocated bytes)."""
        small = tuple(sorted((b[1], b[0]) for seg, b in self._where.values() if seg is None))
        segs = tuple(tuple((b[0], b[1]) for b in s) for s in self.segments)
        return segs, self.small_reserved, small, self.allocated

    @classmethod
    def from_key(cls, limit: int, key: tuple) -> CachingAllocator:
        a = cls(limit)
        segs, a.small_reserved, small, a.allocated = key
        a.segments = [[[size, tag] for size, tag in s] for s in segs]
        for s in a.segments:
            for b in s:
                if b[1] is not None:
                    a._where[b[1]] = (s, b)
        for tag, size in small:
            a._where[tag] = (None, [size, tag])
            a.small_live += size
        return a

    def reset_peaks(self) -> None:
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved

    # -- operations ------------------------------------------------------------------------------
    def malloc(self, tag: object, size: int) -> None:
        size = block_round(size)
        if size <= SMALL_SIZE:
            if self.small_live + size > self.small_reserved:
                grow = -(-(self.small_live + size - self.small_reserved) // SMALL_SEGMENT) * SMALL_SEGMENT
                self._cuda_malloc(grow)  # live only once it has its segment: a failed flush counts no phantom
                self.small_reserved += grow
            self.small_live += size
            self._where[tag] = (None, [size, tag])
        else:
            seg, block = self._best_fit(size)
            if block is None:
                seg = [[self._cuda_malloc(segment_size(size)), None]]
                self.segments.append(seg)
                block = seg[0]
            i = _index(seg, block)
            if block[0] - size > SMALL_SIZE:  # split; the remainder stays cached
                seg.insert(i + 1, [block[0] - size, None])
                block[0] = size
            block[1] = tag
            self._where[tag] = (seg, block)
            size = block[0]
        self.allocated += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, tag: object) -> None:
        seg, block = self._where.pop(tag)
        self.allocated -= block[0]
        if seg is None:
            self.small_live -= block[0]
            return
        block[1] = None
        i = _index(seg, block)
        if i + 1 < len(seg) and seg[i + 1][1] is None:
            block[0] += seg.pop(i + 1)[0]
        if i > 0 and seg[i - 1][1] is None:
            seg[i - 1][0] += seg.pop(i)[0]

    def empty_cache(self) -> None:
        """Return every wholly free segment (and the idle small pool) to the driver."""
        self.segments = [s for s in self.segments if not (len(s) == 1 and s[0][1] is None)]
        self.small_reserved = -(-self.small_live // SMALL_SEGMENT) * SMALL_SEGMENT

    def fragment(self, sizes: tuple[int, ...]) -> None:
        """MemoryModel.fragment's other user: its tags are tuples, which no other caller uses."""
        for tag in [t for t in self._where if isinstance(t, tuple)]:
            self.free(tag)
        try:
            self.malloc(("fragment",), sum(block_round(s) for s in sizes))
            self.free(("fragment",))
        except DeviceOOM:
            sizes = ()
        for i, size in enumerate(sizes):
            self.malloc(("fragment", i), size)
        for i in range(0, len(sizes), 2):
            self.free(("fragment", i))

    def _best_fit(self, size: int) -> tuple[list[list] | None, list | None]:
        best: tuple[list[list] | None, list | None] = (None, None)
        for seg in self.segments:
            for b in seg:
                if b[1] is None and b[0] >= size and (best[1] is None or b[0] < best[1][0]):
                    best = (seg, b)
        return best

    def _cuda_malloc(self, size: int) -> int:
        if self.reserved + size <= self.limit:
            return size
        self.retries += 1
        self.empty_cache()
        if self.reserved + size <= self.limit:
            return size
        raise DeviceOOM(
            f"CUDA out of memory. Tried to allocate {size / MIB:.2f} MiB; {self.allocated / MIB:.2f} MiB "
            f"allocated by steps, {self.reserved / MIB:.2f} MiB reserved of {self.limit / MIB:.2f} MiB free "
            f"after weights, KV pool and workspaces"
        )
