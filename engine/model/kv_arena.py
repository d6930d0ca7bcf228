"""The KV pool in CUDA virtual memory: one address range reserved for the largest pool the device could hold,
with physical memory mapped block by block as the controller grows the pool and unmapped as it shrinks it.

Why: a pool of ordinary tensors is resized by allocating new ones and copying, so every resize moves the tensors,
and the decode CUDA graphs, which hold their addresses, must be captured again (about 0.4 s a batch bucket, the
twin's hypothesis; on short runs the captures after a resize cost more than the resize bought). Here an address
never changes: graphs stay valid across resizes, a grow copies nothing and needs only the bytes it adds (no second
copy of a tensor), and a shrink frees blocks without allocating. vLLM's sleep mode and SGLang's memory saver map
memory the same way (cuMemCreate + cuMemMap); the binding is NVIDIA's `cuda-bindings` (the `cuda` extra).

Layout: block-major. Block b of every layer's K and V lies in one chunk of the range (its bytes rounded up to the
driver's granularity), so a block is one physical allocation, mapped or unmapped whole; layer l's K is the strided
view [blocks, block_size, kv_heads, head_dim] that flash-attn's paged kernel reads (it takes any block stride).
The mapped bytes are outside PyTorch's caching allocator, so the probe adds them to what the allocator reports
(CudaProbe's `outside`), where the controller expects the pool.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.model.attention_metadata import KVCache

if TYPE_CHECKING:
    from engine.model.model_config import ModelConfig

logger = logging.getLogger("headroom.engine")


class VmmDriver(Protocol):
    """The four driver calls the arena needs, so tests can run it over host memory."""

    granularity: int  # bytes: mapping sizes and offsets are multiples of it

    def reserve(self, nbytes: int) -> int:
        """An address range of `nbytes`, nothing mapped."""
        ...

    def map(self, address: int, nbytes: int) -> object:
        """Physical memory at `address`; the handle to unmap it. torch.OutOfMemoryError when the device has none."""
        ...

    def unmap(self, address: int, nbytes: int, handle: object) -> None: ...

    def tensor(self, address: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over the range (reading an unmapped part is a fault: the arena never does)."""
        ...


class KVArena:
    def __init__(
        self, driver: VmmDriver, cfg: ModelConfig, block_size: int, dtype: torch.dtype, max_blocks: int, num_blocks: int
    ) -> None:
        self.driver, self.max_blocks = driver, max_blocks
        shape = (cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
        block_bytes = dtype.itemsize * cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim
        self.chunk = -(-block_bytes // driver.granularity) * driver.granularity
        self.address = driver.reserve(max_blocks * self.chunk)
        raw = driver.tensor(self.address, max_blocks * self.chunk).view(dtype)
        inner = [1]
        for size in reversed(shape[1:]):
            inner.insert(0, inner[0] * size)
        self.base = raw.as_strided((max_blocks, *shape), (self.chunk // dtype.itemsize, *inner))
        self.handles: list[object] = []
        self.resize(num_blocks, {})

    @property
    def num_blocks(self) -> int:
        return len(self.handles)

    @property
    def mapped_bytes(self) -> int:
        return self.num_blocks * self.chunk

    def caches(self, blocks: int | None = None) -> list[KVCache]:
        """Each layer's (K, V) over the first `blocks` blocks (None: the mapped ones): views of the same
        addresses whatever the pool's size. A CUDA graph takes views of the whole range (`max_blocks`): the
        bounds of the K and V writes it captures are those of its views, and it must stay valid as the pool
        grows; only the blocks its tables name are ever touched, and those are mapped."""
        n = self.num_blocks if blocks is None else blocks
        return [(self.base[:n, layer, 0], self.base[:n, layer, 1]) for layer in range(self.base.shape[1])]

    def resize(self, num_blocks: int, moves: dict[int, int]) -> None:
        """Copy the blocks in `moves` (old id -> new id, a shrink's compaction), then map the blocks a grow adds,
        zeroed (slots never written must hold finite values), or unmap those a shrink drops. A grow the device
        cannot hold raises torch.OutOfMemoryError with what it mapped unmapped again: the pool is as it was."""
        if num_blocks > self.max_blocks:
            raise torch.OutOfMemoryError(f"KV pool of {num_blocks} blocks: the reserved range holds {self.max_blocks}")
        if moves:
            src, dst = (torch.tensor(ids, device=self.base.device) for ids in (list(moves), list(moves.values())))
            self.base.index_copy_(0, dst, self.base.index_select(0, src))
        old = self.num_blocks
        try:
            while self.num_blocks < num_blocks:
                self.handles.append(self.driver.map(self._at(self.num_blocks), self.chunk))
        except torch.OutOfMemoryError:
            self._unmap_to(old)
            raise
        self.base[old:num_blocks].zero_()
        self._unmap_to(num_blocks)

    def _at(self, block: int) -> int:
        return self.address + block * self.chunk

    def _unmap_to(self, num_blocks: int) -> None:
        if self.base.device.type == "cuda" and self.num_blocks > num_blocks:
            torch.cuda.synchronize(self.base.device)  # no kernel may still read what goes
        while self.num_blocks > num_blocks:
            self.driver.unmap(self._at(self.num_blocks - 1), self.chunk, self.handles.pop())


class _CudaArray:
    """The __cuda_array_interface__ torch.as_tensor wraps without a copy."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}


class CudaVmm:
    """VmmDriver over NVIDIA's cuda-bindings (driver API; PyTorch has made the device's primary context current)."""

    def __init__(self, cu: Any, device: torch.device) -> None:
        self.cu, self.device = cu, device
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device.index or 0
        self.prop = prop
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granularity = int(self._ok(cu.cuMemGetAllocationGranularity(prop, flag), "granularity"))
        access = cu.CUmemAccessDesc()
        access.location = prop.location
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = [access]

    def _ok(self, result: tuple, call: str) -> Any:
        err, *values = result
        if err == self.cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise torch.OutOfMemoryError(f"CUDA out of memory ({call})")
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver error {err} ({call})")
        return values[0] if values else None

    def reserve(self, nbytes: int) -> int:
        return int(self._ok(self.cu.cuMemAddressReserve(nbytes, 0, 0, 0), "cuMemAddressReserve"))

    def map(self, address: int, nbytes: int) -> object:
        cu, ptr = self.cu, self.cu.CUdeviceptr(address)
        handle = self._ok(cu.cuMemCreate(nbytes, self.prop, 0), "cuMemCreate")
        try:
            self._ok(cu.cuMemMap(ptr, nbytes, 0, handle, 0), "cuMemMap")
            self._ok(cu.cuMemSetAccess(ptr, nbytes, self.access, 1), "cuMemSetAccess")
        except (torch.OutOfMemoryError, RuntimeError):
            cu.cuMemUnmap(ptr, nbytes)  # a no-op error where the map itself failed
            cu.cuMemRelease(handle)
            raise
        return handle

    def unmap(self, address: int, nbytes: int, handle: object) -> None:
        self._ok(self.cu.cuMemUnmap(self.cu.CUdeviceptr(address), nbytes), "cuMemUnmap")
        self._ok(self.cu.cuMemRelease(handle), "cuMemRelease")

    def tensor(self, address: int, nbytes: int) -> torch.Tensor:
        return torch.as_tensor(_CudaArray(address, nbytes), device=self.device)


def cuda_vmm(device: torch.device) -> tuple[CudaVmm | None, str]:
    """The driver for `device`, or None, and why: the pool then copies its tensors on a resize."""
    if device.type != "cuda":
        return None, "not a CUDA device"
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return None, "cuda-bindings is not installed (the `cuda` extra has it)"
    attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    err, supported = cu.cuDeviceGetAttribute(attr, device.index or 0)
    if err != cu.CUresult.CUDA_SUCCESS or not supported:
        return None, "the device does not support CUDA virtual memory management"
    return CudaVmm(cu, device), "CUDA virtual memory: resized in place, graphs kept"
