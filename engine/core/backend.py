"""The contract between the engine and a backend: the torch backend, the twin, a tensor-parallel group, or a
wrapper around one of them (the OOM injector).

Every capability the engine, the server and the benchmarks use is declared in `Backend`. Those a backend may
lack (swapping KV to host memory, work before a step, a warm-up, CUDA graphs, a separate sampler pass, ranks, a
decode burst, a clock that jumps) have a default in `BackendDefaults`, so callers use them without asking whether
they exist; a wrapper delegates method by method (`ForwardingBackend`), so what it changes is read in one
place and what it passes through is listed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Protocol

from engine.core.batch import ModelOutput, SchedulerOutput
from engine.core.kv.blocks import ResizePlan
from telemetry.probes.base import MemoryProbe
from telemetry.record import RankSample


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """What a backend chose at start-up, each with why: logged at start-up and shown in GET /controller/state
    under `plant`, where a fallback that costs speed (no flash-attn, a pool copied on a resize) is seen without
    reading the log."""

    dtype: str
    quantization: str
    attention: str  # the kernel and the KV block size
    kv_pool: str  # how the pool is resized

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


class Backend(Protocol):
    """What runs a step. `execute` never writes into the batch, and raises torch.OutOfMemoryError when the device
    runs out."""

    num_blocks: int  # the KV pool as it is now (resize_kv changes it)
    block_size: int
    eos_token_ids: set[int]
    model_name: str
    vocab_size: int  # the API checks prompt token ids against it
    tokenizer: object | None  # None: the twin, which has no text
    probe: MemoryProbe
    can_swap: bool  # whether `swap` may be called
    sampler_seconds: float  # cumulative seconds of a separate sampler pass inside execute; 0 without one

    @property
    def block_bytes(self) -> int:
        """Device bytes of one KV block, all layers."""
        ...

    @property
    def max_model_len(self) -> int: ...

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        """One forward over the batch; one sampled token per sampling item (and its logprobs where asked for).
        Drops what it keeps for the requests in `batch.finished` first."""
        ...

    def now(self) -> float:
        """Wall time (torch) or virtual time (the twin)."""
        ...

    def advance_to(self, t: float) -> None:
        """Let the idle device wait until `t` on its clock (an open-loop load's next arrival)."""
        ...

    def recover_from_oom(self) -> None:
        """After a failed step: let go of what the backend keeps from the step before (an output it still
        references), which would pin its cached segment through every retry. Not torch.cuda.empty_cache: a
        cudaMalloc that fails releases the cache and retries at once, for this process, where an empty_cache
        between steps hands it to another process short of memory, and the step run again fails for want of it
        (tests/test_hazard_oom_storm.py)."""
        ...

    def resize_kv(self, plan: ResizePlan) -> float:
        """Resize the KV tensors to `plan` (copying the blocks in plan.moves) and set num_blocks; returns the
        seconds it cost. Raises torch.OutOfMemoryError, num_blocks unchanged and every tensor whole, when it
        cannot."""
        ...

    def swap(self, out: list[tuple[str, list[int]]], into: list[tuple[str, list[int]]]) -> float:
        """Only where `can_swap`: copy each `out` request's listed KV blocks to host memory (kept by request id),
        then each `into` request's host copy into its listed blocks (and drop it); returns the seconds."""
        ...

    def prepare(self, batch: SchedulerOutput) -> None:
        """Work before a step and outside its measurement (the CUDA graph of the step's batch bucket, captured
        again after a resize), so the probe's step is the step's own."""
        ...

    def warm_up(self) -> float:
        """Run on the thread that will run the steps, before the first request; returns the seconds."""
        ...

    def capture_graphs(self) -> None:
        """After the start-up pool sizing, whose resizes drop the CUDA graphs of a pool that is copied: every
        bucket's graph again, so that serving starts with all of them."""
        ...

    def rank_samples(self) -> list[RankSample]:
        """Every tensor-parallel rank's latest sample, by rank; empty on one device."""
        ...

    def decode_step(self, positions: list[int], until: float) -> list[int] | None:
        """A decode burst's step (LLMEngine.decode_burst): one decode-only step of sequences whose new KV goes
        to `positions`, exactly as execute() would run it; their sampled tokens, in order. None, with nothing
        changed, where the backend offers no burst, or the step would start at or after `until` or run out
        of memory: the engine then runs the step itself."""
        ...

    def info(self) -> BackendInfo: ...

    def close(self) -> None:
        """Release what outlives the backend object (worker processes)."""
        ...


class BackendDefaults:
    """The defaults of what a backend may lack: no swap, no work before a step, no warm-up, no separate sampler
    pass, no CUDA graphs, one device, no decode burst, a wall clock, nothing to release."""

    can_swap = False
    sampler_seconds = 0.0

    def now(self) -> float:
        return time.monotonic()

    def advance_to(self, t: float) -> None:
        """A wall clock cannot jump: the device waits."""
        time.sleep(max(0.0, t - self.now()))

    def swap(self, out: list[tuple[str, list[int]]], into: list[tuple[str, list[int]]]) -> float:
        raise NotImplementedError(f"{type(self).__name__} cannot swap KV to host memory (can_swap is False)")

    def prepare(self, batch: SchedulerOutput) -> None:
        return None

    def warm_up(self) -> float:
        return 0.0

    def capture_graphs(self) -> None:
        return None

    def rank_samples(self) -> list[RankSample]:
        return []

    def decode_step(self, positions: list[int], until: float) -> list[int] | None:
        return None

    def close(self) -> None:
        return None


class ForwardingBackend(BackendDefaults):
    """A backend around `inner`: every member of the contract passes through to it, one by one, except what a
    subclass overrides. A decode burst never passes through: a wrapper changes the step (an injected OOM, the
    other ranks' share of it), and the inner backend's burst would run the step without it."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def block_bytes(self) -> int:
        return self.inner.block_bytes

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    @property
    def eos_token_ids(self) -> set[int]:
        return self.inner.eos_token_ids

    @property
    def model_name(self) -> str:
        return self.inner.model_name

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def tokenizer(self) -> object | None:
        return self.inner.tokenizer

    @property
    def probe(self) -> MemoryProbe:
        return self.inner.probe

    @property
    def can_swap(self) -> bool:  # type: ignore[override]
        return self.inner.can_swap

    @property
    def sampler_seconds(self) -> float:  # type: ignore[override]
        return self.inner.sampler_seconds

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        return self.inner.execute(batch)

    def now(self) -> float:
        return self.inner.now()

    def advance_to(self, t: float) -> None:
        self.inner.advance_to(t)

    def recover_from_oom(self) -> None:
        self.inner.recover_from_oom()

    def resize_kv(self, plan: ResizePlan) -> float:
        return self.inner.resize_kv(plan)

    def swap(self, out: list[tuple[str, list[int]]], into: list[tuple[str, list[int]]]) -> float:
        return self.inner.swap(out, into)

    def prepare(self, batch: SchedulerOutput) -> None:
        self.inner.prepare(batch)

    def warm_up(self) -> float:
        return self.inner.warm_up()

    def capture_graphs(self) -> None:
        self.inner.capture_graphs()

    def rank_samples(self) -> list[RankSample]:
        return self.inner.rank_samples()

    def info(self) -> BackendInfo:
        return self.inner.info()

    def close(self) -> None:
        self.inner.close()
