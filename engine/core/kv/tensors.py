"""The KV cache's device tensors, where they are not in CUDA virtual memory (vmm.py): one K and one V tensor a
layer in flash-attn's paged layout, resized by copying, swapped block by block to host memory."""

from __future__ import annotations

import math
import mmap
from typing import TYPE_CHECKING

import torch

from engine.model.attention_metadata import KVCache

if TYPE_CHECKING:
    from engine.model.model_config import ModelConfig


def zeroed_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zero-filled K or V tensor: slots never written must hold finite values (masked keys multiply them
    by zero). On CPU it lives on its own anonymous private mapping, which the kernel promises reads as
    zeros (mmap(2): MAP_ANONYMOUS contents are initialized to zero) and backs with memory only where it is
    first written: a pool costs resident memory for the blocks in use, not for its size, and its pages go
    back to the system when the tensor is freed. torch.zeros would write, and so keep, every page at once.
    On other devices: torch.zeros."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # MAP_ANONYMOUS is implied by fileno -1; private so that the pages are this process's own
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype).view(shape)


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str | torch.device
) -> list[KVCache]:
    """One (k, v) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim] (flash-attn's paged
    layout), zero-filled (zeroed_kv_tensor)."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [
        (zeroed_kv_tensor(shape, dtype, device), zeroed_kv_tensor(shape, dtype, device)) for _ in range(cfg.num_layers)
    ]


def resize_kv_cache(caches: list[KVCache], num_blocks: int, moves: dict[int, int]) -> None:
    """Resize every K and V tensor to `num_blocks` blocks in place in `caches`, one tensor at a time: the
    blocks in `moves` (old id -> new id) are copied first, then a new zero-filled tensor (zeroed_kv_tensor:
    on CPU its new blocks stay unwritten, so not resident) takes the kept blocks and replaces the old one,
    which is freed before the next tensor is made. So the transient above the old pool is the growth plus
    one tensor, and each layer keeps one contiguous tensor (what flash-attn's paged kernel reads). A shrink
    whose new tensor finds no device memory (another process took every free byte) stages the kept blocks
    through host memory and frees the old tensor first; the freed tensor then holds the next one, so in
    practice only the first is staged."""
    if not caches:
        return
    device = caches[0][0].device
    src = torch.tensor(list(moves), dtype=torch.long, device=device)
    dst = torch.tensor(list(moves.values()), dtype=torch.long, device=device)
    for layer in range(len(caches)):
        for which in (0, 1):
            old = caches[layer][which]
            if old.shape[0] == num_blocks and not moves:  # already this size (a grow rolled back part way)
                continue
            if moves:
                old.index_copy_(0, dst, old.index_select(0, src))
            keep = min(num_blocks, old.shape[0])
            shape = (num_blocks, *old.shape[1:])
            try:
                new = zeroed_kv_tensor(shape, old.dtype, device)
            except torch.OutOfMemoryError:
                if num_blocks >= old.shape[0]:
                    raise
                kept = old[:keep].cpu()
                del old
                caches[layer] = _replaced(caches[layer], which, kept)  # drops the last device reference
                new, old = zeroed_kv_tensor(shape, kept.dtype, device), kept
            _copy_kept(new, old, keep)
            caches[layer] = _replaced(caches[layer], which, new)
            del old


def swap_out_blocks(caches: list[KVCache], blocks: list[int]) -> list[KVCache]:
    """Copies of `blocks` of every layer's K and V in host memory (preemption by swap). From a CUDA device
    the copies land in pinned (page-locked) memory, as vLLM's swap space does: the DMA engine then moves
    them at the PCIe link's rate, about twice what a copy through pageable memory reaches."""
    device = caches[0][0].device
    idx = torch.tensor(blocks, dtype=torch.long, device=device)

    def to_host(t: torch.Tensor) -> torch.Tensor:
        host = torch.empty((len(blocks), *t.shape[1:]), dtype=t.dtype, pin_memory=device.type == "cuda")
        return host.copy_(t.index_select(0, idx))

    return [(to_host(k), to_host(v)) for k, v in caches]


def swap_in_blocks(caches: list[KVCache], blocks: list[int], host: list[KVCache]) -> None:
    """Write a swap_out_blocks copy into `blocks` (new ids, as many as were swapped out), layer by layer."""
    device = caches[0][0].device
    idx = torch.tensor(blocks, dtype=torch.long, device=device)
    for (k, v), (hk, hv) in zip(caches, host, strict=True):
        k.index_copy_(0, idx, hk.to(device))
        v.index_copy_(0, idx, hv.to(device))


def _copy_kept(new: torch.Tensor, old: torch.Tensor, keep: int) -> None:
    """new[:keep] = old[:keep], into a zero-filled `new`. On CPU only the blocks with a nonzero byte are
    copied: the others are bitwise equal to new's zeros already, and writing them would make the pages of
    every never-used block resident."""
    if new.device.type != "cpu":
        new[:keep].copy_(old[:keep])
        return
    written = old[:keep].flatten(1).view(torch.uint8).any(dim=1).nonzero().squeeze(1)
    new.index_copy_(0, written, old.index_select(0, written))


def _replaced(pair: KVCache, which: int, tensor: torch.Tensor) -> KVCache:
    return (tensor, pair[1]) if which == 0 else (pair[0], tensor)


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
