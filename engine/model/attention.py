"""Paged KV cache and attention over it, for a flattened ragged batch (every sequence's new tokens
concatenated).

Five kernels share one metadata object (engine/model/attention_metadata.py):
- `cpu` (CPU, the default there): a C++ kernel that reads each token's context from the paged cache in
  place, in fp32 (engine/model/cpu_kernels.py, engine/model/csrc/paged_attention.cpp); batch-invariant by
  construction.
- `sdpa` (CPU and CUDA; on CPU, where the C++ kernel cannot be built): written out in torch as matmul,
  masked fp32 softmax, matmul, on contiguous operands in one layout for decodes and prefills alike. A
  token's result then depends only on its query and its own context: masked keys add exact zeros, and each
  bf16 matmul output is reduced in a fixed order. So a token's output is bitwise the same alone, batched,
  in a chunked prefill or after a recompute, which greedy batch invariance rests on.
  `F.scaled_dot_product_attention` on CPU changes a token's low bits with the number of queries computed
  beside it, so it is not used.
- `flash` (CUDA only): flash-attn's varlen kernel reading the paged cache through `block_table`; it needs
  `block_size % 256 == 0`. Fast, but without the bitwise guarantee.
- `flash_decode` (CUDA graphs): flash-attn's `flash_attn_with_kvcache` over the same paged cache for a
  decode-only step, with its lengths on the device (engine/model/cuda_graphs.py).
- `triton_decode` (CUDA graphs where flash-attn is not installed): the same step in a Triton kernel
  (engine/model/triton_decode.py), reading the cache the sdpa kernel writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.model.attention_metadata import AttentionMetadata, AttentionSpec, KVCache, key_blocks, windowed
from engine.model.cpu_kernels import cpu_paged_attention
from engine.model.triton_decode import paged_decode_attention

if TYPE_CHECKING:
    from engine.model.cuda_graphs import DecodeGraphMetadata

FLASH_BLOCK_MULTIPLE = 256


def check_backend(name: str, block_size: int, device: torch.device) -> None:
    """Raise ValueError when `name` cannot run with this block size on this device."""
    if name == "sdpa":
        return
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on the CPU, device is {device.type}")
        return
    if name != "flash":
        raise ValueError(f"unknown attention backend {name!r}: use 'cpu', 'sdpa' or 'flash'")
    if device.type != "cuda":
        raise ValueError("attention backend 'flash' needs a CUDA device; use 'sdpa' on CPU")
    if block_size % FLASH_BLOCK_MULTIPLE:
        raise ValueError(
            f"attention backend 'flash' needs block_size to be a multiple of {FLASH_BLOCK_MULTIPLE} "
            f"(flash-attn's paged KV requirement), got {block_size}"
        )


def build_attention_metadata(
    seqs: list[tuple[int, int, list[int]]],
    block_size: int,
    device: str | torch.device,
    backend: str = "sdpa",
) -> AttentionMetadata:
    """`seqs`: (start, num_tokens, block_table) per sequence, in batch order. Token `start + j` goes to slot
    `block_table[p // block_size] * block_size + p % block_size` with p = start + j."""
    slots: list[int] = []
    for start, n, table in seqs:
        for p in range(start, start + n):
            slots.append(table[p // block_size] * block_size + p % block_size)
    # padded with block 0 (finite values, masked) up to the widest range a kernel reads
    width = max(max(len(table), key_blocks(start + n, block_size)) for start, n, table in seqs)
    tables = [table + [0] * (width - len(table)) for _, _, table in seqs]
    return AttentionMetadata(
        backend=backend,
        block_size=block_size,
        query_lens=[n for _, n, _ in seqs],
        context_lens=[start + n for start, n, _ in seqs],
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    meta: AttentionMetadata | DecodeGraphMetadata,
    spec: AttentionSpec,
) -> torch.Tensor:
    """q [T, H, hd], k/v [T, KVH, hd] for the new tokens (RoPE applied). Writes k/v into their slots, then
    returns attention output [T, H, hd]: each token attends causally to its sequence's cached context (the
    last `spec.window` keys of it in a sliding layer)."""
    if meta.backend == "cpu":  # writes k/v itself
        return cpu_paged_attention(q, k, v, kv_cache, meta, spec)
    k_cache, v_cache = kv_cache
    # (block, offset) rather than a flat view: a pool in CUDA virtual memory (engine/core/kv/vmm.py) strides its blocks
    where = (meta.slot_mapping // k_cache.shape[1], meta.slot_mapping % k_cache.shape[1])
    k_cache.index_put_(where, k)
    v_cache.index_put_(where, v)
    if meta.backend == "flash":
        return _flash(q, kv_cache, meta, spec)
    if meta.backend == "flash_decode":
        return _flash_decode(q, kv_cache, meta, spec)
    if meta.backend == "triton_decode":
        if spec.window is not None or spec.softcap is not None:
            raise ValueError("the Triton decode kernel has no sliding window or soft-capping (cuda_graphs.py)")
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, spec.scale)
    return _sdpa(q, kv_cache, meta, spec)


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[B, blocks] block ids -> contiguous [B, KVH, blocks * block_size, hd]. Contiguous on purpose: matmul
    picks its bf16 kernel (and so the summation order) from the operands' strides, and a strided view
    takes a different kernel for B == 1 than for B > 1."""
    b, n = tables.shape
    _, bs, kvh, hd = cache.shape
    # index_select: faster than advanced indexing (cache[tables]) on CPU
    return cache.index_select(0, tables.reshape(-1)).view(b, n * bs, kvh, hd).transpose(1, 2).contiguous()


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    mask: torch.Tensor,
    spec: AttentionSpec,
) -> torch.Tensor:
    """q [B, KVH, M, hd] contiguous: each KV head's query rows, M = group * R with row g * R + r for query
    head g of token r; tables [B, blocks]; mask [B, R, keys], True where token r sees a key. Returns
    [B, KVH, M, hd]. Scores in the model dtype, soft-capped and softmaxed in fp32, as HF's eager attention
    does."""
    # V stays [L, hd]: torch's bf16 matmul is faster on V as [hd, L] (transposed), but that kernel
    # rounds a row differently depending on how many rows come with it, which would break invariance.
    keys, values = _gather(k_cache, tables), _gather(v_cache, tables)
    b, kvh, m, _ = q.shape
    scores = (torch.matmul(q, keys.transpose(-1, -2)) * spec.scale).float()
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if spec.window is not None:
        mask = windowed(mask, spec.window)
    r = mask.shape[1]
    scores.view(b, kvh, m // r, r, -1).masked_fill_(~mask[:, None, None], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), values)


def _sdpa(q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
    k_cache, v_cache = kv_cache
    kvh, hd = k_cache.shape[2:]
    heads = q.shape[1]
    group = heads // kvh
    out = q.new_empty(q.shape)  # contiguous even though q is a strided view
    if (plan := meta.decode_plan) is not None:
        rows, tables, mask = plan
        b = tables.shape[0]
        qd = q.reshape(b, kvh, group, hd) if rows is None else q.index_select(0, rows).view(b, kvh, group, hd)
        o = _attend(qd, k_cache, v_cache, tables, mask[:, None], spec).view(b, heads, hd)
        if rows is None:  # a decode-only step
            return o
        out.index_copy_(0, rows, o)
    for start, n, tables, causal in meta.prefill_plan:
        # [n, H, hd] -> [1, KVH, group * n, hd]: row g * n + j is query head (kv, g) of token j
        qs = q[start : start + n].view(n, kvh, group, hd).permute(1, 2, 0, 3).reshape(1, kvh, group * n, hd)
        o = _attend(qs, k_cache, v_cache, tables, causal[None], spec)
        out[start : start + n] = o.view(kvh, group, n, hd).permute(2, 0, 1, 3).reshape(n, heads, hd)
    return out


def _flash_options(spec: AttentionSpec) -> dict[str, object]:
    """flash-attn's arguments for a layer's spec: its window counts the keys before the token's own."""
    window = (-1, -1) if spec.window is None else (spec.window - 1, 0)
    return {"softmax_scale": spec.scale, "window_size": window, "softcap": spec.softcap or 0.0}


def _flash(q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func  # CUDA-only dependency, imported when used

    k_cache, v_cache = kv_cache
    return flash_attn_varlen_func(q, k_cache, v_cache, causal=True, **meta.flash_args, **_flash_options(spec))


def _flash_decode(q: torch.Tensor, kv_cache: KVCache, meta: DecodeGraphMetadata, spec: AttentionSpec) -> torch.Tensor:
    """One new token per sequence, every length read on the device (`cache_seqlens`), so the launch is the
    same whatever the step's contexts: what a captured CUDA graph needs (engine/model/cuda_graphs.py)."""
    from flash_attn import flash_attn_with_kvcache

    k_cache, v_cache = kv_cache
    out = flash_attn_with_kvcache(
        q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens, block_table=meta.block_tables, causal=True,
        **_flash_options(spec),
    )  # fmt: skip
    return out.squeeze(1)
