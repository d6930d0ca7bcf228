"""CUDA graphs for decode steps, as vLLM and gpt-fast do it: a decode-only step of n sequences replays
the graph captured for the smallest batch bucket that holds n, its inputs padded up to that bucket.

Why: at small batch a decode step of a large model is bound by launching a few hundred kernels from
Python, not by the GPU; one graph replay launches them all at once. Why buckets: a graph is fixed in its
shapes, and one per batch size would cost memory and capture time for every size a server ever sees.

What a graph needs, and where it comes from:
- static inputs: token ids, positions, KV slots, block tables and sequence lengths live in buffers sized
  for the largest bucket; a step copies its values in, and the padding rows repeat the last real row
  (same token, position and slot), so they write that row's own K and V again and their outputs are
  dropped;
- attention whose launch does not depend on the step's lengths: flash-attn's `flash_attn_with_kvcache`
  reads them from `cache_seqlens` on the device (engine/model/attention.py, backend "flash_decode"), and where
  flash-attn is not installed a Triton kernel does the same over the sdpa kernel's cache ("triton_decode",
  engine/model/triton_decode.py); the sdpa kernel itself sizes its gathers on the host, so it runs eagerly;
- the KV tensors it captured: a pool resize replaces them, so the backend drops every graph then and
  captures a bucket again before its next decode step (`capture_for`, from the backend's `prepare`).
Where the memory goes, and why the controller sees it: every bucket is captured at start-up, largest first,
into one private pool (a torch.cuda.MemPool the backend keeps), before the controller's profiling steps, so
the pool and the cuBLAS workspaces are in the idle footprint those steps measure; a capture after a resize
reuses the kept pool, so it takes no new memory, and it runs between steps, outside any measured step. Every
capture warms up on the same side stream: a stream's first GEMM gets a cuBLAS workspace for the life of the
process, so a fresh stream per capture would add one per bucket.
Prefills and mixed steps, batches above the largest bucket, and `--enforce-eager` run eagerly. A capture
that fails turns graphs off for the process (logged), and the step runs eagerly.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.model.triton_decode import triton_unusable_reason

if TYPE_CHECKING:
    from engine.model.model_config import ModelConfig

logger = logging.getLogger("headroom.engine")

# vLLM's default capture sizes up to 256: 1, 2, 4, then every 8
CAPTURE_SIZES = (1, 2, 4, *range(8, 257, 8))

Replay = Callable[[], torch.Tensor]
DecodeInputs = tuple[list[int], list[int], list[int], list[list[int]]]  # ids, positions, KV slots, block tables
Capture = Callable[[Callable[[], torch.Tensor]], Replay]


def bucket_for(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest capture size that holds n sequences; None past the largest."""
    i = bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def pad_rows(values: list, size: int) -> list:
    """`values` padded to `size` entries by repeating its last one."""
    return values + [values[-1]] * (size - len(values))


def decode_graph_kernel(
    device: torch.device, attention: str, cfg: ModelConfig, block_size: int, eager: str | None
) -> tuple[str | None, str]:
    """The attention kernel decode graphs capture, or None (every step eager), and why. `eager`: why the caller
    runs eagerly anyway (--enforce-eager; a tensor-parallel rank, whose all-reduce is a collective the driver
    issues, not a kernel a graph could hold)."""
    if device.type != "cuda":
        return None, "no CUDA"
    if eager is not None:
        return None, eager
    if attention == "flash":
        return "flash_decode", "flash-attn's paged decode"
    if cfg.sliding_layers or cfg.attn_softcap is not None:
        return None, "flash-attn absent, and Triton's paged decode has no sliding window or soft-capping"
    blocker = triton_unusable_reason(device, cfg.head_dim, block_size)
    return (None, blocker) if blocker else ("triton_decode", "flash-attn absent: Triton's paged decode")


class DecodeItem(Protocol):
    """What a decode-only step's item tells the graph: the engine's ScheduledItem (the model sits below the
    engine core and names none of its types)."""

    @property
    def start(self) -> int:
        """The position of its one new token."""
        ...

    @property
    def block_table(self) -> list[int]: ...

    @property
    def token_ids(self) -> Sequence[int]: ...


def decode_inputs(items: Sequence[DecodeItem], block_size: int) -> DecodeInputs:
    """A decode-only step's token ids, positions, KV slots and block tables, a row per sequence."""
    positions = [it.start for it in items]
    tables = [it.block_table for it in items]
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions, strict=True)]
    return [it.token_ids[0] for it in items], positions, slots, tables


def cuda_graph_capture(pool: tuple[int, int]) -> Capture:
    """A capture into `pool` (shared by every bucket): warm up on the side stream as torch.cuda.graph
    requires, record, and return the replay, which hands back the graph's static output."""
    side = torch.cuda.Stream()

    def capture(fn: Callable[[], torch.Tensor]) -> Replay:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


@dataclass
class DecodeGraphMetadata:
    """The attention inputs of a captured decode step, all on the device (engine/model/attention.py reads it
    as it reads AttentionMetadata)."""

    slot_mapping: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor  # [B] int32: keys each row attends to, its new token included
    backend: str  # the decode kernel: "flash_decode" or "triton_decode"


class DecodeGraphs:
    """Captured decode steps of one model over one set of KV tensors, by batch bucket."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, DecodeGraphMetadata], torch.Tensor],
        max_blocks_per_seq: int,
        device: torch.device,
        capture: Capture,
        kernel: str,
        sizes: tuple[int, ...] = CAPTURE_SIZES,
    ) -> None:
        """forward(ids, positions, meta) -> hidden [B, D]: the model over the KV tensors it captures; `kernel`:
        the attention backend of the captured steps (DecodeGraphMetadata.backend)."""
        self.forward, self.capture, self.kernel, self.sizes = forward, capture, kernel, tuple(sorted(sizes))
        top = self.sizes[-1]
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.meta = DecodeGraphMetadata(
            slot_mapping=torch.zeros(top, dtype=torch.long, device=device),
            block_tables=torch.zeros(top, max_blocks_per_seq, dtype=torch.int32, device=device),
            seq_lens=torch.ones(top, dtype=torch.int32, device=device),
            backend=kernel,
        )
        self.width = max_blocks_per_seq
        self.replays: dict[int, Replay] = {}
        self.disabled = False

    def fits(self, n: int, longest_table: int) -> bool:
        return not self.disabled and bucket_for(n, self.sizes) is not None and longest_table <= self.width

    def load(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]) -> int:
        """Copy a decode step's inputs into the static buffers, padded to its bucket; returns the bucket. Only the
        columns of the step's longest table are written: the tables are as wide as the longest context (8,192
        blocks for a 128K model), building them whole in Python cost more than the step, and the decode kernels
        read no block past a row's length, so what earlier steps left beyond it is never read."""
        size = bucket_for(len(ids), self.sizes)
        width = max(len(t) for t in tables)
        rows = [t + [0] * (width - len(t)) for t in pad_rows(tables, size)]
        host = torch.tensor([pad_rows(ids, size), pad_rows(positions, size), pad_rows(slots, size)], dtype=torch.long)
        self.ids[:size].copy_(host[0], non_blocking=True)
        self.positions[:size].copy_(host[1], non_blocking=True)
        self.meta.slot_mapping[:size].copy_(host[2], non_blocking=True)
        self.meta.seq_lens[:size].copy_(host[1] + 1, non_blocking=True)
        self.meta.block_tables[:size, :width].copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)
        return size

    def run(
        self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]
    ) -> torch.Tensor | None:
        """Hidden states [n, D] of a decode step of n = len(ids) sequences (the caller checked `fits`), or
        None when its graph cannot be captured (graphs are then off; run the step eagerly)."""
        size = self.load(ids, positions, slots, tables)
        replay = self.replays.get(size) or self._capture(size)
        return None if replay is None else replay()[: len(ids)]

    def has_graph(self, n: int) -> bool:
        return bucket_for(n, self.sizes) in self.replays

    def capture_for(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]) -> None:
        """Capture the graph the decode step with these inputs replays (a resize dropped it), between steps, so
        that the capture's time and memory are not the step's. The capture runs the forward over the step's own
        inputs: it writes the K and V the step will write again, and no other slot (the buffers' last contents
        may name blocks that now hold another sequence's tokens)."""
        self._capture(self.load(ids, positions, slots, tables))

    def capture_all(self) -> None:
        """Every bucket without a graph, largest first: the pool's segment is cut once for the largest working
        set, and each smaller capture reuses its freed blocks. Only before any request holds a block: the
        buffers' inputs write K and V into the pool's first slots."""
        for size in reversed(self.sizes):
            if self.disabled:
                return
            if size not in self.replays:
                self._capture(size)

    def _capture(self, size: int) -> Replay | None:
        meta = DecodeGraphMetadata(
            self.meta.slot_mapping[:size], self.meta.block_tables[:size], self.meta.seq_lens[:size], self.kernel
        )
        try:
            replay = self.capture(lambda: self.forward(self.ids[:size], self.positions[:size], meta))
        except Exception:  # a capture failure must cost speed, never a request
            logger.exception("CUDA graph capture failed at batch %d; decode runs eagerly from now on", size)
            self.disabled = True
            return None
        self.replays[size] = replay
        return replay
