"""The attention kernel and the KV block size, chosen together.

Why together: flash-attn's paged kernel reads the cache through `block_table` only when a block holds a
multiple of 256 tokens (upstream flash_api.cpp: "Paged KV cache block size must be divisible by 256"),
while the sdpa kernel gathers blocks and wastes less of the pool with small ones: no one fixed default
suits both. So the block size follows the kernel: 256 where flash-attn runs (a CUDA device, flash_attn
that loads, a 16-bit dtype), else 16. An explicit block size is kept, and `auto` then takes flash only
where that size suits it. On the CPU `auto` takes the C++ paged kernel (engine/model/cpu_kernels.py), which
reads blocks of any size in place, and the torch kernel (`sdpa`) where those kernels cannot run (the
backend logs a warning with the reason). A flash-attn older than 2.5 has no `block_table` (paged KV) and counts
as missing, and so does one whose compiled extension does not load (built for another torch or CUDA): being
found on the path is not enough, the first step would raise its ImportError out of the backend.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from dataclasses import dataclass

import torch

from engine.model.attention import FLASH_BLOCK_MULTIPLE, check_backend
from engine.model.cpu_kernels import unusable_reason as cpu_kernel_unusable_reason

SMALL_BLOCK_SIZE = 16  # small blocks waste less of the pool; the cpu and sdpa kernels have no size rule
FLASH_BLOCK_SIZE = FLASH_BLOCK_MULTIPLE
FLASH_PAGED_KV_VERSION = (2, 5)  # flash-attn 2.5.0 added block_table to flash_attn_varlen_func


@dataclass(frozen=True)
class KernelChoice:
    attention: str  # "flash", "cpu" or "sdpa"
    block_size: int
    reason: str  # why, for the start-up log


def flash_unusable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when flash-attn can run here; else what stands in the way."""
    if device.type != "cuda":
        return f"flash-attn needs CUDA, device is {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs a 16-bit dtype, dtype is {str(dtype).removeprefix('torch.')}"
    if (load_error := flash_attn_load_error()) is not None:
        return load_error
    version = _flash_attn_version()
    if version is not None and tuple(int(n) for n in re.findall(r"\d+", version)[:2]) < FLASH_PAGED_KV_VERSION:
        return f"flash-attn {version} predates paged KV (block_table, 2.5); the `cuda` extra pins a newer one"
    return None


@functools.cache
def flash_attn_load_error() -> str | None:
    """None when the entry points the engine calls import; else why not. Imported, not looked up: a wheel built
    for another torch is found on the path and fails only when its extension loads (an undefined symbol). Cached:
    a failed import runs the package's __init__ again on every try."""
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
    except (ImportError, OSError) as err:
        if isinstance(err, ModuleNotFoundError) and err.name == "flash_attn":  # not a module flash_attn imports
            return "flash_attn is not installed (the Dockerfile's gpu stage builds it; see the README)"
        first_line = next(iter(str(err).splitlines()), "")
        return f"flash_attn does not load ({type(err).__name__}: {first_line}); rebuild it against this torch and CUDA"
    return None


def _flash_attn_version() -> str | None:
    """The installed distribution's version, read without importing its CUDA extension; None for a module that
    no distribution installed (a source tree, a test's stand-in)."""
    try:
        return importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        return None


def choose_kernel(attention: str, block_size: int | None, device: torch.device, dtype: torch.dtype) -> KernelChoice:
    """`attention`: auto, flash, cpu or sdpa; `block_size` None: the kernel's default. Raises ValueError when
    an explicit choice cannot run (flash off CUDA, with a block size it cannot page, or where flash-attn is
    missing or does not load; cpu off the CPU, or where it does not build): at start-up, not at the first step."""
    if attention == "auto" and device.type == "cpu":
        blocker = cpu_kernel_unusable_reason(device, dtype)
        if blocker is None:
            return KernelChoice("cpu", block_size or SMALL_BLOCK_SIZE, "auto: the C++ paged kernel")
        return KernelChoice("sdpa", block_size or SMALL_BLOCK_SIZE, f"auto: sdpa ({blocker})")
    if attention == "auto":
        blocker = flash_unusable_reason(device, dtype)
        if blocker is None and block_size is not None and block_size % FLASH_BLOCK_MULTIPLE:
            blocker = f"block size {block_size} is not a multiple of {FLASH_BLOCK_MULTIPLE}"
        if blocker is None:
            return KernelChoice("flash", block_size or FLASH_BLOCK_SIZE, "auto: flash-attn paged KV")
        return KernelChoice("sdpa", block_size or SMALL_BLOCK_SIZE, f"auto: sdpa ({blocker})")
    default = FLASH_BLOCK_SIZE if attention == "flash" else SMALL_BLOCK_SIZE
    chosen = block_size or default
    check_backend(attention, chosen, device)
    if attention == "cpu" and (blocker := cpu_kernel_unusable_reason(device, dtype)) is not None:
        raise ValueError(f"attention backend 'cpu' cannot run: {blocker}")
    if attention == "flash" and (blocker := flash_unusable_reason(device, dtype)) is not None:
        raise ValueError(f"attention backend 'flash' cannot run: {blocker}")
    return KernelChoice(attention, chosen, f"{attention}, as asked")
