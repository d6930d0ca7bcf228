"""What one step's attention needs to know, shared by every layer and every kernel: where each sequence's
new tokens sit in the flat batch and in the paged KV cache, and the index tensors each kernel reads,
built once on first use. A leaf module (torch only), so that the attention dispatch, the C++ kernels'
bindings and the model can all take it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch

# sdpa pads every key range to a multiple of this many keys (masked), so that all its matmuls take the
# same blocked bf16 kernel: torch uses a plain loop (another summation order) for tiny ones.
KEY_ALIGN = 32
# sdpa attends a long prefill in runs of this many queries, each over the keys it can see: causal masking
# then skips about half the score matrix, and the step's peak memory stays bounded.
QUERY_CHUNK = 256
# one layer's (K, V), each [num_blocks, block_size, num_kv_heads, head_dim]
KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer attends, beyond causally over its sequence: what sets the families' layers apart
    (engine/model/model_config.py)."""

    scale: float  # the scores' factor
    window: int | None = None  # keys a token sees, itself included (a sliding layer); None: all before it
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap) before the softmax


def windowed(mask: torch.Tensor, window: int) -> torch.Tensor:
    """A mask whose rows each see a prefix of the keys, cut to the last `window` keys of that prefix."""
    first = mask.sum(-1, keepdim=True) - window
    return mask & (torch.arange(mask.shape[-1], device=mask.device) >= first)


def key_blocks(context_len: int, block_size: int) -> int:
    """Blocks the sdpa kernel reads for a context: enough for it, rounded up to whole KEY_ALIGNs."""
    align = max(1, KEY_ALIGN // block_size)
    return -(-context_len // (block_size * align)) * align


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens sit in the flat batch and in the paged cache, for one step.
    Shared by every layer; the per-kernel index tensors are built once, on first use."""

    backend: str
    block_size: int
    query_lens: list[int]  # new tokens per sequence this step
    context_lens: list[int]  # KV tokens per sequence after this step's tokens are written
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with block 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device

    def blocks_for(self, context_len: int) -> int:
        return key_blocks(context_len, self.block_size)

    @cached_property
    def query_starts(self) -> list[int]:
        return [0, *accumulate(self.query_lens)][:-1]

    @cached_property
    def token_plan(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For the `cpu` kernel, per new token (int32 [T] each): its sequence's row in block_tables, and how
        many keys it sees (its position + 1)."""
        seq = [i for i, n in enumerate(self.query_lens) for _ in range(n)]
        ctx = [c - n + j for n, c in zip(self.query_lens, self.context_lens, strict=True) for j in range(1, n + 1)]
        return torch.tensor(seq, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32)

    @cached_property
    def decode_plan(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
        """Sequences with one new token attend together: (their rows in the flat batch, None when every
        sequence decodes; their block tables cut to the longest context; key-valid mask [B, keys])."""
        seqs = [i for i, n in enumerate(self.query_lens) if n == 1]
        if not seqs:
            return None
        ctx = [self.context_lens[i] for i in seqs]
        num_blocks = self.blocks_for(max(ctx))
        keys = torch.arange(num_blocks * self.block_size, device=self.device)
        mask = keys[None, :] < torch.tensor(ctx, device=self.device)[:, None]
        if len(seqs) == len(self.query_lens):
            return None, self.block_tables[:, :num_blocks], mask
        rows = torch.tensor([self.query_starts[i] for i in seqs], device=self.device)
        tables = self.block_tables.index_select(0, torch.tensor(seqs, device=self.device))[:, :num_blocks]
        return rows, tables, mask

    @cached_property
    def prefill_plan(self) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """Per run of at most QUERY_CHUNK new tokens of a sequence with several: (first row in the flat
        batch, token count, block table [1, blocks] cut to the run's last key, causal mask [n, keys])."""
        plan = []
        for i, (n, ctx) in enumerate(zip(self.query_lens, self.context_lens, strict=True)):
            if n == 1:
                continue
            for first in range(0, n, QUERY_CHUNK):
                m = min(QUERY_CHUNK, n - first)
                end = ctx - n + first + m  # keys this run sees
                tables = self.block_tables[i : i + 1, : self.blocks_for(end)]
                keys = torch.arange(tables.shape[1] * self.block_size, device=self.device)
                causal = keys[None, :] <= torch.arange(end - m, end, device=self.device)[:, None]
                plan.append((self.query_starts[i] + first, m, tables, causal))
        return plan

    @cached_property
    def flash_args(self) -> dict[str, object]:
        def cumulative(lens: list[int]) -> torch.Tensor:
            return torch.tensor([0, *accumulate(lens)], dtype=torch.int32, device=self.device)

        return {
            "cu_seqlens_q": cumulative(self.query_lens),
            "cu_seqlens_k": cumulative(self.context_lens),
            "max_seqlen_q": max(self.query_lens),
            "max_seqlen_k": max(self.context_lens),
            "block_table": self.block_tables,
        }
