"""Device memory of the twin: a fixed idle footprint plus a per-step allocation trace replayed through a
model of PyTorch's CUDA caching allocator.

Why an allocator model and not a formula: what kills a step is not the bytes it needs but whether
cudaMalloc can still find them. The allocator keeps freed segments cached (reserved > allocated), reuses
them best-fit, splits them, and only returns them to the driver when a cudaMalloc fails (flush, then one
retry). A tensor that outlives its step pins its segment, so the same step can pass on a clean cache and
fail after a different shape ran before it. The trace sizes are the real tensor sizes of the model
(profile [model]); the fitted parts are named in the profile's [memory] section.
"""

from __future__ import annotations

from typing import NamedTuple

from engine.backends.twin.memo import LRUMemo
from engine.backends.twin.profile import Profile

MIB = 1 << 20
SMALL_SIZE = 1 << 20  # allocations up to 1 MiB come from the small pool (2 MiB segments)
SMALL_SEGMENT = 2 << 20
MIN_LARGE_ALLOC = 10 << 20  # below this a large allocation gets a 20 MiB segment
LARGE_SEGMENT = 20 << 20
ROUND_LARGE = 2 << 20
# Allocator states and (state, step) replays remembered. A matrix point visits a few dozen states and a
# 300-request vLLM replay a few hundred; a long-running server forgets the least recently used past this.
MEMO_SIZE = 8192


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


class StepMemory(NamedTuple):
    """The features of a step that decide its dynamic allocations."""

    logits_rows: int
    sampled: int
    prefill_seqs: int


class StepResult(NamedTuple):
    peak_allocated: int  # dynamic bytes (above the persistent footprint) at the step's peak
    peak_reserved: int  # dynamic reserved bytes at the step's peak
    allocated_before: int  # dynamic bytes live when the step began (the retained output)
    retries: int  # cudaMalloc retries (cache flushes) during the step
    oom: str | None  # the error message when the step failed


class MemoryModel:
    """Idle footprint + per-step allocator replay, memoized on (allocator state, step features) in LRU
    memos of `memo_size` entries (a forgotten replay is recomputed, with the same result).

    Persistent bytes (weights, KV pool, graph pools/workspaces) are allocated once at start-up in their
    own segments and never freed, so they only shrink the allocator's limit. The step trace allocates, in
    order, what the seed engine sizes at run time: a workspace per prompt in the step, the logits (fp32,
    one row per token through lm_head), the sampler's probabilities. The logits stay referenced until the
    next step's replace them (the engine keeps its previous output), so they are live during that step.
    """

    def __init__(self, profile: Profile, num_blocks: int, block_size: int, memo_size: int = MEMO_SIZE) -> None:
        dev, model, mem = profile.section("device"), profile.section("model"), profile.section("memory")
        self.cuda_total = int(dev["cuda_total_bytes"])
        self.nvml_total = int(dev["nvml_total_bytes"])
        self.context = int(dev["cuda_context_bytes"])
        self.weights = int(model["weight_bytes"])
        self.block_bytes = block_size * int(model["kv_bytes_per_token"])
        self.workspaces = int(mem["idle_workspace_bytes"])
        self.external = 0  # bytes other processes hold on the device
        self.graph_bytes = 0  # CUDA graph pool and cuBLAS workspaces, outside the step trace (sensors.py)
        self._set_pool(num_blocks)
        self.logit_row = model["vocab"] * int(mem["logits_dtype_bytes"])
        self.prob_row = model["vocab"] * 4
        self.per_prefill_seq = int(mem["prefill_seq_workspace_bytes"])
        self.retain_output = bool(mem["retain_previous_logits"])
        # Between steps the allocator is just its key, interned to an int for cheap memo lookups. Ids are
        # never reused, so a memo entry naming a forgotten state is a miss, never a wrong state.
        self._state_ids: LRUMemo[tuple, int] = LRUMemo(memo_size)
        self._states: LRUMemo[int, tuple[tuple, int]] = LRUMemo(memo_size)  # id -> (key, reserved bytes)
        self._next_id = 0
        self.state_id, self._current = self._intern(CachingAllocator(self.limit).key())
        self._memo: LRUMemo[tuple, tuple[int, StepResult]] = LRUMemo(memo_size)
        self.held = 0  # tag of the retained logits (0: none)
        self.retries = 0
        self.ooms = 0

    def _set_pool(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.kv_pool = num_blocks * self.block_bytes
        self.persistent = self.weights + self.kv_pool + self.workspaces
        self.limit = self.cuda_total - self.context - self.persistent - self.external - self.graph_bytes

    @property
    def idle_nvml_used(self) -> int:
        """What nvidia-smi shows before the first step (fact F1)."""
        return self.context + self.persistent

    @property
    def driver_free(self) -> int:
        """Bytes cudaMalloc can still get from the driver without flushing this process's cache."""
        return self.limit - self.reserved

    def resize_pool(self, num_blocks: int) -> None:
        """Map or unmap the blocks the pool gains or loses, in place (the torch backend's pool in CUDA virtual
        memory, engine/model/kv_arena.py): a grow needs only the bytes it adds, and when the driver has too few
        the backend empties the allocator's cache and tries once more; a shrink allocates nothing, and the backend
        empties the cache after it, so that what the pool gave up reaches whoever is short of memory (a shrink
        is for memory another process wants). A grow that still does not fit raises DeviceOOM and the pool is
        unchanged."""
        growth = (num_blocks - self.num_blocks) * self.block_bytes
        if growth > self.driver_free:
            self.empty_cache()
            if growth > self.driver_free:
                raise DeviceOOM(
                    f"CUDA out of memory growing the KV pool by {growth / MIB:.0f} MiB: "
                    f"{self.driver_free / MIB:.0f} MiB free"
                )
        self._set_pool(num_blocks)
        if growth < 0:
            self.empty_cache()

    def set_graph_bytes(self, nbytes: int) -> None:
        """CUDA graph pools and cuBLAS workspaces hold `nbytes` of the driver's memory (sensors.py)."""
        self.graph_bytes = nbytes
        self._set_pool(self.num_blocks)

    def set_external(self, nbytes: int) -> int:
        """Another process holds `nbytes` of the device (0: it let go). It can only take what the driver
        has free (never this process's cached segments): returns what it holds."""
        self.external = 0
        self._set_pool(self.num_blocks)
        self.external = max(0, min(nbytes, self.driver_free))
        self._set_pool(self.num_blocks)
        return self.external

    def fragment(self, sizes: tuple[int, ...]) -> None:
        """Fault injection (bench/fault_run.py): another user of this allocator frees what it held, then
        carves blocks of `sizes` (each over 1 MiB) in order out of a cached segment of their sum and frees every
        other one, from the first: the live ones split the segment and pin it against a flush until the next
        call. When the driver cannot give that segment (after a flush), that user takes nothing."""
        a = CachingAllocator.from_key(self.limit, self.state)
        for tag in [t for t in a._where if isinstance(t, tuple)]:  # only this method's tags are tuples
            a.free(tag)
        try:
            a.malloc(("fragment",), sum(block_round(s) for s in sizes))
            a.free(("fragment",))
        except DeviceOOM:
            sizes = ()
        for i, size in enumerate(sizes):
            a.malloc(("fragment", i), size)
        for i in range(0, len(sizes), 2):
            a.free(("fragment", i))
        self.state_id, self._current = self._intern(a.key())

    def _intern(self, key: tuple) -> tuple[int, tuple[tuple, int]]:
        sid = self._state_ids.get(key)
        entry = self._states.get(sid) if sid is not None else None
        if entry is None:
            if sid is None:
                sid, self._next_id = self._next_id, self._next_id + 1
                self._state_ids.put(key, sid)
            segs, small = key[0], key[1]
            entry = self._states.put(sid, (key, sum(size for s in segs for size, _ in s) + small))
        return sid, entry

    @property
    def state(self) -> tuple:
        return self._current[0]

    @property
    def reserved(self) -> int:
        """Dynamic bytes the allocator holds from the driver now (cached or live)."""
        return self._current[1]

    def checkpoint(self) -> tuple:
        """Everything a step changes, for `restore` (the bench's fast path undoes a step it will not take)."""
        return self.state_id, self._current, self.held, self.retries, self.ooms

    def restore(self, checkpoint: tuple) -> None:
        self.state_id, self._current, self.held, self.retries, self.ooms = checkpoint

    @property
    def allocated(self) -> int:
        """Dynamic bytes live now: the retained output between steps."""
        return self.state[3]

    def device_used(self) -> int:
        """NVML's used bytes: this process's footprint plus what other processes hold."""
        return self.context + self.persistent + self.reserved + self.external + self.graph_bytes

    def trace(self, m: StepMemory, held: int, new: int) -> list[tuple[str, object, int]]:
        """The step's dynamic allocations in order: (op, tag, bytes), op "a"llocate or "f"ree. The decoder
        layers' activations are not here: they live in the engine's preallocated workspace (F1's idle
        ~4200 MiB), so only what is sized by the request mix at run time is dynamic."""
        ops: list[tuple[str, object, int]] = []
        if m.prefill_seqs:
            ops.append(("a", "ws", m.prefill_seqs * self.per_prefill_seq))
        if m.logits_rows:
            ops.append(("a", new, m.logits_rows * self.logit_row))
        if m.sampled:
            ops += [("a", "probs", m.sampled * self.prob_row), ("f", "probs", 0)]
        if m.prefill_seqs:
            ops.append(("f", "ws", 0))
        if held:
            ops.append(("f", held, 0))  # the previous output is dropped once this one exists
        if m.logits_rows and not self.retain_output:
            ops.append(("f", new, 0))
        return ops

    def run_step(self, m: StepMemory) -> StepResult:
        """Replay one step. On failure the step's tensors are freed (the exception unwinds them) and the
        allocator is left as the failed cudaMalloc left it; the retained output of the step before stays."""
        held = self.held
        new = 2 if held == 1 else 1  # two alternating tags keep memo keys small
        key = (self.state_id, m, held, self.limit)
        hit = self._memo.get(key)
        entry = self._states.get(hit[0]) if hit is not None else None
        if entry is None:
            a = CachingAllocator.from_key(self.limit, self.state)
            a.reset_peaks()
            before = a.allocated
            oom = None
            ops = self.trace(m, held, new)
            try:
                for op, tag, size in ops:
                    if op == "a":
                        a.malloc(tag, size)
                    else:
                        a.free(tag)
            except DeviceOOM as e:
                oom = str(e)
                for tag in list(a._where):
                    if tag != held:
                        a.free(tag)
            res = StepResult(a.peak_allocated, a.peak_reserved, before, a.retries, oom)
            sid, entry = self._intern(a.key())
            hit = self._memo.put(key, (sid, res))
        self.state_id, res = hit
        self._current = entry
        self.retries += res.retries
        if res.oom is not None:
            self.ooms += 1
        else:
            self.held = new if self.retain_output and m.logits_rows else 0
        return res

    def drop_output(self) -> None:
        """The engine lets go of the previous step's output (its recovery from an OOM: the step runs again and
        makes its own). Its segment stays cached, for this process's next cudaMalloc to reuse or release."""
        if self.held:
            a = CachingAllocator.from_key(self.limit, self.state)
            a.free(self.held)
            self.held = 0
            self.state_id, self._current = self._intern(a.key())

    def empty_cache(self) -> None:
        a = CachingAllocator.from_key(self.limit, self.state)
        a.empty_cache()
        self.state_id, self._current = self._intern(a.key())
