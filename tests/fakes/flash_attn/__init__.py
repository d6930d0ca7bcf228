"""A stand-in for flash-attn 2's paged entry points, in plain torch, for tests on machines without CUDA.

It takes upstream's signatures (flash_attn/flash_attn_interface.py) and enforces the checks upstream's
flash_api.cpp makes on a paged cache, so a call that this fake accepts is shaped the way the real kernel
wants: k/v caches [num_blocks, page_block_size, kv_heads, head_dim] with page_block_size % 256 == 0,
block_table int32 with a contiguous last dimension, cu_seqlens int32. Only tests put it on sys.path.
"""

from __future__ import annotations

import torch

__version__ = "0.0-fake"
CALLS: list[str] = []  # entry points called, in order, for tests to read


def _check_paged(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise RuntimeError("paged k/v cache must be [num_blocks, page_block_size, nheads_k, headdim]")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:  # any block stride, as flash-attn's k_batch_stride
        raise RuntimeError("Input tensor must have contiguous last dimension")
    if k_cache.shape[1] % 256:
        raise RuntimeError("Paged KV cache block size must be divisible by 256")
    if block_table.dtype != torch.int32:
        raise RuntimeError("block_table must have dtype torch.int32")
    if block_table.stride(-1) != 1:
        raise RuntimeError("block_table must have contiguous last dimension")


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    causal: bool,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [n, H, d] over keys/values [L, KVH, d]; causal aligned bottom-right, as flash-attn does; a query sees
    `window_size[0]` keys before its own where that is not -1; softcap > 0 caps the scores with tanh."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).float()
    v = values.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    n, length = q.shape[0], keys.shape[0]
    key, query = torch.arange(length)[None, :], torch.arange(length - n, length)[:, None]
    allowed = key <= query if causal else torch.ones(n, length, dtype=torch.bool)
    if window_size[0] >= 0:
        allowed &= key >= query - window_size[0]
    scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v).to(q.dtype)


def _context(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    return cache.index_select(0, table_row.long()).flatten(0, 1)[:length]


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    CALLS.append("flash_attn_varlen_func")
    if block_table is None:
        raise NotImplementedError("the fake covers the paged (block_table) form only")
    _check_paged(k, v, block_table)
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must have dtype int32")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    qs, ks = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.empty_like(q)
    for i in range(len(qs) - 1):
        length = ks[i + 1] - ks[i]
        keys, values = _context(k, block_table[i], length), _context(v, block_table[i], length)
        out[qs[i] : qs[i + 1]] = _attend(q[qs[i] : qs[i + 1]], keys, values, scale, causal, window_size, softcap)
    return out


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """q [B, seqlen_q, H, d]; cache_seqlens [B] int32: keys each row attends to."""
    CALLS.append("flash_attn_with_kvcache")
    if k is not None or v is not None:
        raise NotImplementedError("the fake does not append k/v itself")
    _check_paged(k_cache, v_cache, block_table)
    if cache_seqlens is None or cache_seqlens.dtype != torch.int32:
        raise RuntimeError("cache_seqlens must have dtype int32")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for i, length in enumerate(cache_seqlens.tolist()):
        keys, values = _context(k_cache, block_table[i], length), _context(v_cache, block_table[i], length)
        out[i] = _attend(q[i], keys, values, scale, causal, window_size, softcap)
    return out
