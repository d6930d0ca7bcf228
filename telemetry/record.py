"""The step record: the one message from the plant (engine) to the controller, metrics and traces."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepShape:
    """The phase mix of one step: the features the controller's estimator regresses peak memory on."""

    prefill_tokens: int = 0  # new prompt tokens computed this step (all chunks)
    prefill_seqs: int = 0
    decode_seqs: int = 0
    sum_context: int = 0  # KV tokens attended over all sequences, after the step's tokens are written
    max_context: int = 0
    prefill_attn: int = 0  # sum over prefill chunks of chunk * context: the score-matrix term
    sampled_seqs: int = 0  # sequences that produce a token (logits rows)

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs


@dataclass
class MemorySample:
    """What a memory probe saw during one step. Bytes throughout; None where the device cannot tell."""

    peak_allocated: int = 0  # allocator peak since the step began (includes the idle baseline)
    reserved: int = 0  # allocator reserved bytes at the step's peak
    idle_baseline: int = 0  # allocated bytes with no step running: weights, KV pool, workspaces
    capacity: int = 0  # bytes the allocator may use on this device (real or emulated)
    device_used: int | None = None  # NVML (or equivalent) used bytes, sampled
    # The allocator's reserved bytes when a device_used held from an earlier step was read (None: device_used
    # was read in this step). NVML is read at most every ~100 ms, so device_used lags the allocator: paired
    # with this step's reserved, a reading taken before an empty_cache would count the bytes given back since
    # as memory outside the allocator. Paired with the reserved bytes of its own moment, it stays exact.
    device_used_reserved: int | None = None
    device_total: int | None = None
    alloc_retries: int = 0  # cumulative allocator retries (cudaMalloc failed, cache flushed, retried)
    ooms: int = 0  # cumulative allocator OOMs
    sampled: bool = True  # False when the probe skipped this step to stay cheap (values are stale)

    @property
    def step_peak(self) -> int:
        """Bytes the step itself added above idle: what the controller predicts."""
        return max(0, self.peak_allocated - self.idle_baseline)


@dataclass
class RankSample:
    """One tensor-parallel rank's own view of a step: its probe's sample and the KV pool it holds (every rank
    holds the same blocks, each of its own shard of the heads)."""

    rank: int
    memory: MemorySample
    kv_blocks: int = 0
    kv_block_bytes: int = 0  # this rank's bytes of one block, all layers

    @property
    def kv_bytes(self) -> int:
        return self.kv_blocks * self.kv_block_bytes


@dataclass
class StepRecord:
    step_id: int
    time: float  # wall or virtual seconds at the step's start
    duration: float  # seconds
    shape: StepShape
    memory: MemorySample
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    # Free blocks already spoken for: what running sequences still need for the tokens they have (the rest of
    # a chunked prefill or recompute, the next decode's slot) and what waiting ones need for theirs.
    kv_blocks_owed: int = 0
    oom: bool = False
    preempted: int = 0  # sequences preempted (by recompute) while scheduling this step
    prefix_cache_queries: int = 0  # tokens of the sequences admitted this step, when prefix caching is on
    prefix_cache_hits: int = 0  # of those, tokens whose KV the prefix cache already held
    num_running: int = 0
    num_waiting: int = 0
    limits: dict = field(default_factory=dict)  # the limits in force, as plain numbers
    # Tensor parallel: every rank's own sample, by rank; `memory` is then their tightest-rank combination
    # (controller/tightest_rank.py). Empty on one device.
    ranks: list[RankSample] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)
