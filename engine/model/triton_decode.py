"""Paged decode attention in Triton: one new token per sequence, reading the paged KV cache in place, with every
length read on the device. What a captured CUDA graph needs where flash-attn is not installed (a wheel built for
the exact torch and CUDA, or an hour of nvcc): the sdpa kernel sizes its gathers on the host from the step's
lengths, so it cannot be captured, and without graphs a decode step of a large model at small batch is bound by
launching a few hundred kernels from Python. Triton ships with PyTorch's CUDA wheels.

One program per (sequence, KV head): it walks that sequence's blocks through its block table, keeps the group of
query heads that share the KV head together (each K and V block is read once for all of them), and accumulates
with an online softmax in fp32. Any block stride: a pool in CUDA virtual memory (engine/core/kv/vmm.py) packs
the blocks of all layers together. Not batch-invariant against the sdpa kernel (another summation order): a
graph's greedy tokens may differ from eager ones where the best two logits tie at bf16's precision, as
flash-attn's do.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch


def triton_unusable_reason(device: torch.device, head_dim: int, block_size: int) -> str | None:
    """None when the kernel can run here; else what stands in the way."""
    if device.type != "cuda":
        return f"Triton's decode kernel needs CUDA, device is {device.type}"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (PyTorch's CUDA wheels bring it)"
    for name, n in (("head size", head_dim), ("block size", block_size)):
        if n < 16 or n & (n - 1):
            return f"Triton's decode kernel needs a power of two from 16 for the {name}, got {n}"
    return None


@functools.cache
def _kernel() -> Any:
    """The jitted kernel, made on first use: importing triton costs a second, and TRITON_INTERPRET (the tests' CPU
    interpreter) is read when a kernel is decorated."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale,
        q_seq, q_head, k_block, k_tok, k_head, v_block, v_tok, v_head, o_seq, o_head, table_row,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr,
    ):  # fmt: skip
        seq, kv_head = tl.program_id(0), tl.program_id(1)
        heads = tl.arange(0, GROUP_PAD)
        toks = tl.arange(0, BLOCK)
        dims = tl.arange(0, DIM)
        live = heads < GROUP
        q_rows = q_ptr + seq * q_seq + (kv_head * GROUP + heads)[:, None] * q_head + dims[None, :]
        q = tl.load(q_rows, mask=live[:, None], other=0.0).to(tl.float32) * scale
        length = tl.load(lens_ptr + seq)
        best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
        for b in range(0, tl.cdiv(length, BLOCK)):
            block = tl.load(tables_ptr + seq * table_row + b).to(tl.int64)
            seen = b * BLOCK + toks < length
            k = tl.load(k_ptr + block * k_block + toks[:, None] * k_tok + kv_head * k_head + dims[None, :],
                        mask=seen[:, None], other=0.0).to(tl.float32)  # fmt: skip
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK]
            scores = tl.where(seen[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            weights = tl.exp(scores - new_best[:, None])
            rescale = tl.exp(best - new_best)
            v = tl.load(v_ptr + block * v_block + toks[:, None] * v_tok + kv_head * v_head + dims[None, :],
                        mask=seen[:, None], other=0.0).to(tl.float32)  # fmt: skip
            acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
            total = total * rescale + tl.sum(weights, axis=1)
            best = new_best
        out = acc / total[:, None]
        o_rows = out_ptr + seq * o_seq + (kv_head * GROUP + heads)[:, None] * o_head + dims[None, :]
        tl.store(o_rows, out.to(out_ptr.dtype.element_ty), mask=live[:, None])

    return paged_decode


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, H, D], one token per sequence, RoPE applied; caches [blocks, block_size, KVH, D] (any block stride);
    block_tables [B, W] int32; seq_lens [B] int32, keys each sequence attends to (its new token's included, already
    written); scale: the scores' factor. Returns [B, H, D] in q's dtype."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    b, heads, dim = q.shape
    kv_heads, block = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    launch: Callable[..., Any] = _kernel()[(b, kv_heads)]
    launch(
        q, k_cache, v_cache, out, block_tables, seq_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(1, 1 << (group - 1).bit_length()), BLOCK=block, DIM=dim,
    )  # fmt: skip
    return out
