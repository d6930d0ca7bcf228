"""The CPU KV pool is resident only where it is written (issue #14): a pool is allocated, read, grown and
shrunk without its never-written blocks becoming resident memory, while reading as zeros throughout and
counting in full in the engine's memory accounting. Measured from the process's anonymous RSS."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.core.kv.tensors import allocate_kv_cache, resize_kv_cache
from engine.model.llama import ModelConfig
from telemetry.probes.cpu import tensor_bytes
from telemetry.units import MIB

# 2 layers x (K, V) x 8192 blocks x 8 KiB (16 tokens x 4 heads x 64 x bf16): 64 MiB a tensor, 256 MiB a pool
CFG = ModelConfig(100, 256, 64, 2, 4, 4, 64)
NUM_BLOCKS, BLOCK_SIZE, BLOCK_BYTES = 8192, 16, 8 * 1024
POOL_BYTES = 4 * NUM_BLOCKS * BLOCK_BYTES
# what else this process may allocate meanwhile, plus a huge page per tensor where THP is always on
SLACK = 16 * MIB

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssAnon from /proc")


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def tensors(pool: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    return [t for kv in pool for t in kv]


def test_pool_reads_zero_and_is_resident_only_where_written() -> None:
    base = rss_anon()
    pool = allocate_kv_cache(CFG, NUM_BLOCKS, BLOCK_SIZE, torch.bfloat16, "cpu")
    assert tensor_bytes(tensors(pool)) == POOL_BYTES  # the accounting counts the pool the engine holds
    assert not any(t.any() for t in tensors(pool))  # reading the zero pages maps nothing
    assert rss_anon() - base < SLACK
    written = 1024
    for t in tensors(pool):
        t[:written] = 1.0
    grown = rss_anon() - base
    assert 4 * written * BLOCK_BYTES <= grown < 4 * written * BLOCK_BYTES + SLACK
    del pool, t
    assert rss_anon() - base < SLACK  # the mappings go back on delete


def test_resize_keeps_blocks_and_leaves_unwritten_ones_unresident() -> None:
    """A grow and a compacting shrink: the written blocks (one of them moved) come through bit for bit,
    every other block reads zero, and the copies make only the written blocks resident."""
    pool = allocate_kv_cache(CFG, NUM_BLOCKS // 2, BLOCK_SIZE, torch.bfloat16, "cpu")
    for i, t in enumerate(tensors(pool)):
        t[5] = i + 1.0
        t[3000] = -0.0  # nonzero bits: a copy that only looked at values would drop the sign
    base = rss_anon()
    resize_kv_cache(pool, NUM_BLOCKS, {})
    assert rss_anon() - base < SLACK
    resize_kv_cache(pool, 64, {3000: 7})
    for i, t in enumerate(tensors(pool)):
        assert t.shape[0] == 64
        assert torch.equal(t[5], torch.full_like(t[5], i + 1.0))
        assert t[7].view(torch.int16).eq(torch.tensor(-0.0, dtype=torch.bfloat16).view(torch.int16)).all()
        rest = torch.cat([t[:5], t[6:7], t[8:]])
        assert not rest.view(torch.int16).any()
    assert rss_anon() - base < SLACK
