"""CPU probe: measured live-tensor bytes per step, against an emulated device capacity.

CPU torch has no allocator statistics, so the probe counts for itself: a TorchDispatchMode sees every
aten op, adds the bytes of each freshly allocated output storage, subtracts them when the storage is
freed (a weakref callback), and keeps the step's peak. peak_allocated = idle baseline (weights + KV
pool, set by the backend) + that peak: the same meaning as the CUDA allocator's peak, so the
controller learns the same thing on both. What it cannot see: scratch memory allocated inside a single
kernel (it is a lower bound on RSS growth) and in-place growth (`resize_`).

The dispatch hook costs tens of microseconds per op and a decode step runs thousands of ops, so the
probe samples: every step whose (power-of-two bucketed) shape it has not measured yet, and every
`sample_every`-th step -- unless its own measured cost already exceeds `overhead_budget` (default 0.5%)
of the wall time of all steps so far, which keeps the amortized cost bounded on any machine. Other steps
report the bucket's last measurement with sampled=False.

The probe's own cost cannot be timed from inside the hook (the C++ -> Python round trip grows with an
op's argument count, so a tiny op's cost understates a model op's). So a sampled step's cost is
measured like a benchmark would: its duration minus the running mean duration of unsampled steps
of the same shape bucket; until a bucket has unsampled steps, the in-hook estimate (calibrated round
trip x ops + timed bookkeeping, a lower bound) stands in.

Emulated OOM (`emulate_oom`) raises torch.OutOfMemoryError from inside the op that pushed live bytes
over capacity. Only sampled steps can OOM: an unsampled step runs untracked, whatever it allocates.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from telemetry.probes.cgroup import CgroupMemory
from telemetry.record import MemorySample, StepShape

_DISPATCH_COST: float | None = None  # seconds per op of the dispatch-mode round trip, measured once


def _torch() -> Any:
    import torch  # lazy: telemetry must import without torch

    return torch


def shape_bucket(shape: StepShape) -> tuple[int, int, int]:
    """Power-of-two bucket of the features peak memory grows with (bit_length = ceil(log2(x+1)))."""
    return (shape.prefill_tokens.bit_length(), shape.decode_seqs.bit_length(), shape.max_context.bit_length())


def tensor_bytes(objs: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind tensors and nn.Modules (params + buffers): a helper for
    backends to compute the idle baseline (weights + KV pool) they hand the probe."""
    torch = _torch()
    seen: set[int] = set()
    total = 0
    for obj in objs:
        tensors = [*obj.parameters(), *obj.buffers()] if isinstance(obj, torch.nn.Module) else [obj]
        for t in tensors:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    return total


class _Ref(weakref.ref):
    """A weakref to an output storage that remembers what it counted (cheaper than a closure)."""

    __slots__ = ("ptr", "nbytes")


class _StepState:
    """Live/peak bytes of one sampled step. A fresh one per step, so frees of tensors from older steps
    (their weakref callbacks) cannot disturb this step's count."""

    __slots__ = ("live", "peak", "limit", "oom", "ops", "bookkeeping", "by_ptr", "freed")

    def __init__(self, limit: int | None) -> None:
        self.live = 0
        self.peak = 0
        self.limit = limit  # step bytes allowed before an emulated OOM; None: no emulation
        self.oom = False
        self.ops = 0
        self.bookkeeping = 0.0
        self.by_ptr: dict[int, _Ref] = {}
        self.freed = self._freed  # bind once: one bound method for every weakref

    def _freed(self, ref: _Ref) -> None:
        t0 = time.perf_counter()  # frees are tracking cost too, though they run outside the dispatch
        if self.by_ptr.get(ref.ptr) is ref:
            del self.by_ptr[ref.ptr]
            self.live -= ref.nbytes
        self.bookkeeping += time.perf_counter() - t0


_TRACKER_CLASS: Any = None
# op -> how its returns allocate: 0 none fresh (views, in-place, out=), 1 one fresh tensor, 2 general
_KIND: dict[Any, int] = {}
_FRESH: dict[Any, tuple[bool, ...]] = {}


def _op_kind(func: Any) -> int:
    # Returns without alias info are new tensors; views and in-place/out= results alias an input.
    fresh = tuple(r.alias_info is None for r in func._schema.returns)
    _FRESH[func] = fresh
    kind = 0 if not any(fresh) else 1 if fresh == (True,) and str(func._schema.returns[0].type) == "Tensor" else 2
    _KIND[func] = kind
    return kind


def _fresh_outputs(func: Any, out: Any, kind: int) -> Iterable[Any]:
    """What `func` returned as new tensors, for an op of kind 1 or 2 (_op_kind)."""
    if kind == 1:
        return (out,)
    outs = out if isinstance(out, tuple) else (out,)
    tensors: list[Any] = []
    for is_fresh, o in zip(_FRESH[func], outs, strict=False):
        if is_fresh:
            tensors.extend(o if isinstance(o, list) else (o,))
    return tensors


def _count_new_storages(state: _StepState, tensors: Iterable[Any], tensor_type: type) -> bool:
    """Add each storage behind `tensors` that the step has not counted to its live bytes, with a weakref that
    takes it off when freed. True when any was added."""
    grew = False
    by_ptr = state.by_ptr
    for t in tensors:
        if not isinstance(t, tensor_type):
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if not ptr or ptr in by_ptr:  # empty/meta, or already counted (e.g. _unsafe_view)
            continue
        ref = _Ref(storage, state.freed)
        ref.ptr, ref.nbytes = ptr, storage.nbytes()
        by_ptr[ptr] = ref
        state.live += ref.nbytes
        grew = True
    return grew


def _tracker_class() -> Any:
    """The TorchDispatchMode subclass, built once on first use (torch imported lazily)."""
    global _TRACKER_CLASS
    if _TRACKER_CLASS is not None:
        return _TRACKER_CLASS
    torch = _torch()
    from torch.utils._python_dispatch import TorchDispatchMode

    tensor_type = torch.Tensor
    oom_error = torch.OutOfMemoryError
    perf = time.perf_counter

    class _Tracker(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # No torch._disable_dynamo wrapper around every call (a large share of the per-op cost): the probe
            # brackets eager steps, nothing here is meant to be compiled.
            return False

        def __init__(self, state: _StepState) -> None:
            super().__init__()
            self.state = state

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            t0 = perf()
            state = self.state
            state.ops += 1
            kind = _KIND.get(func)
            if kind is None:
                kind = _op_kind(func)
            fresh = _fresh_outputs(func, out, kind) if kind else ()
            if _count_new_storages(state, fresh, tensor_type) and state.live > state.peak:
                state.peak = state.live
                if state.limit is not None and state.peak > state.limit:
                    state.oom = True
                    state.bookkeeping += perf() - t0
                    raise oom_error(
                        f"emulated OOM: step holds {state.peak} live bytes, {state.limit} fit beside the "
                        f"idle baseline (at {func})"
                    )
            state.bookkeeping += perf() - t0
            return out

    _TRACKER_CLASS = _Tracker
    return _Tracker


def measure_dispatch_cost(iterations: int = 300) -> float:
    """Seconds one op spends in a no-op TorchDispatchMode round trip (C++ -> Python -> C++), which the
    tracker cannot time from inside itself. Measured once per process in thread CPU time, so a
    busy neighbour at that moment does not inflate it for the life of the process. Running a mode also
    pays torch's one-time set-up of dispatch modes here instead of in a served step."""
    global _DISPATCH_COST
    if _DISPATCH_COST is not None:
        return _DISPATCH_COST
    torch = _torch()
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Noop(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # as in _Tracker

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    _tracker_class()
    a = torch.zeros(4)
    clock = time.thread_time
    best_plain = best_mode = float("inf")
    for _ in range(3):  # best of 3
        t0 = clock()
        for _ in range(iterations):
            torch.add(a, a)
        t1 = clock()
        with _Noop():
            for _ in range(iterations):
                torch.add(a, a)
        t2 = clock()
        best_plain, best_mode = min(best_plain, t1 - t0), min(best_mode, t2 - t1)
    _DISPATCH_COST = max(0.0, (best_mode - best_plain) / iterations)
    return _DISPATCH_COST


class CpuProbe:
    """Live-tensor-bytes probe for the CPU backend, with an emulated capacity (`--device-memory`)."""

    name = "cpu"

    def __init__(
        self,
        capacity: int,
        *,
        idle_bytes: int = 0,
        sample_every: int = 8,
        overhead_budget: float | None = 0.005,
        emulate_oom: bool = True,
        measure_overhead: bool = True,
        cgroup: CgroupMemory | None = None,
    ) -> None:
        """`idle_bytes`: weights + KV pool, set by the backend (and moved by `add_idle` when its pool is resized).
        `sample_every`: track every Nth step (1 = every step, 0 = only shapes not seen before).
        `overhead_budget`: skip the periodic samples while tracking has cost more than this fraction of
        total step time (None: no cap). New shapes are always sampled.
        `cgroup`: the memory cgroup whose limit is `capacity`; every step then reports its used memory as
        the device's (telemetry/probes/cgroup.py), so what the tensors do not show (the Python heap, the
        allocator's caches) counts as memory outside the allocator, as NVML's used bytes do on CUDA."""
        self.capacity = capacity
        self.cgroup = cgroup
        self.idle_bytes = idle_bytes
        self.sample_every = sample_every
        self.overhead_budget = overhead_budget
        self.emulate_oom = emulate_oom
        # Calibrating also warms torch's dispatch-mode machinery up, out of the first served step.
        self.dispatch_cost = measure_dispatch_cost() if measure_overhead else 0.0
        self._estimates: dict[tuple[int, int, int], int] = {}
        self._last = MemorySample(peak_allocated=idle_bytes, idle_baseline=idle_bytes, capacity=capacity)
        self.steps = 0
        self.sampled_steps = 0
        self.ops_tracked = 0
        self.ooms = 0  # emulated OOMs raised (cumulative, like the CUDA allocator's num_ooms)
        self.bookkeeping_seconds = 0.0  # timed inside the hook
        self.overhead_seconds = 0.0  # cumulative cost of tracking, held against overhead_budget
        self.last_step_overhead = 0.0
        self.step_seconds = 0.0  # wall time inside all step brackets (tracking included)
        self._plain_duration: dict[tuple[int, int, int], float] = {}  # mean unsampled step, per bucket

    def add_idle(self, nbytes: int) -> None:
        self.idle_bytes += nbytes

    @property
    def hook_overhead_seconds(self) -> float:
        """The in-hook lower bound: timed bookkeeping + ops x the calibrated (tiny-op) round trip."""
        return self.bookkeeping_seconds + self.ops_tracked * self.dispatch_cost

    def should_sample(self, shape: StepShape) -> bool:
        if shape_bucket(shape) not in self._estimates:
            return True
        if self.sample_every <= 0 or self.steps % self.sample_every:
            return False
        budget = self.overhead_budget
        return budget is None or self.overhead_seconds <= budget * self.step_seconds

    @contextmanager
    def step(self, shape: StepShape) -> Iterator[None]:
        key = shape_bucket(shape)
        sampled = self.should_sample(shape)
        self.steps += 1
        idle = self.idle_bytes
        start = time.perf_counter()
        if not sampled:
            try:
                yield
            finally:
                duration = time.perf_counter() - start
                self.step_seconds += duration
                plain = self._plain_duration.get(key)
                self._plain_duration[key] = duration if plain is None else plain + 0.2 * (duration - plain)
                estimate = idle + self._estimates[key]
                self._last = MemorySample(
                    peak_allocated=estimate,
                    reserved=estimate,
                    idle_baseline=idle,
                    capacity=self.capacity,
                    ooms=self.ooms,
                    sampled=False,
                    **self._device_memory(),
                )
            return
        state = _StepState(self.capacity - idle if self.emulate_oom else None)
        mode = _tracker_class()(state)
        mode.__enter__()
        try:
            yield
        finally:
            mode.__exit__(None, None, None)
            duration = time.perf_counter() - start
            self.step_seconds += duration
            self.sampled_steps += 1
            self.ops_tracked += state.ops
            self.bookkeeping_seconds += state.bookkeeping
            self.ooms += state.oom
            plain = self._plain_duration.get(key)
            hook = state.bookkeeping + state.ops * self.dispatch_cost
            self.last_step_overhead = hook if plain is None or state.oom else max(0.0, duration - plain)
            self.overhead_seconds += self.last_step_overhead
            self._estimates[key] = state.peak
            self._last = MemorySample(
                peak_allocated=idle + state.peak,
                reserved=idle + state.peak,
                idle_baseline=idle,
                capacity=self.capacity,
                ooms=self.ooms,
                **self._device_memory(),
            )
            # Forget outputs that outlive the step: dropping the refs also drops their callbacks.
            state.by_ptr.clear()

    def _device_memory(self) -> dict[str, int]:
        if self.cgroup is None:
            return {}
        return {"device_used": self.cgroup.used(), "device_total": self.capacity}

    def sample(self) -> MemorySample:
        return self._last
