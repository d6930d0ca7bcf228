"""Device memory of the twin: a fixed idle footprint plus a per-step allocation trace replayed through a
model of PyTorch's CUDA caching allocator (engine/backends/twin/allocator.py, which says why a model and not a
formula). The trace sizes are the real tensor sizes of the model (profile [model]); the fitted parts are named
in the profile's [memory] section.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from engine.backends.twin.allocator import MIB, CachingAllocator, DeviceOOM
from engine.backends.twin.memo import LRUMemo
from engine.backends.twin.profile import Profile

# Allocator states and (state, step) replays remembered. A matrix point visits a few dozen states and a
# 300-request vLLM replay a few hundred; a long-running server forgets the least recently used past this.
MEMO_SIZE = 8192


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
        memory, engine/core/kv/vmm.py): a grow needs only the bytes it adds, and when the driver has too few
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
        self._between_steps(lambda a: a.fragment(sizes))

    def _between_steps(self, change: Callable[[CachingAllocator], None]) -> None:
        """Apply `change` to the allocator as it stands between steps, and keep the state it leaves."""
        a = CachingAllocator.from_key(self.limit, self.state)
        change(a)
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
            self._between_steps(lambda a: a.free(self.held))
            self.held = 0

    def empty_cache(self) -> None:
        self._between_steps(CachingAllocator.empty_cache)
