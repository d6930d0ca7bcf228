"""The KV pool in CUDA virtual memory: one address range reserved for the largest pool the device could hold,
with physical memory mapped granule by granule as the controller grows the pool and unmapped as it shrinks it.

Why: a pool of ordinary tensors is resized by allocating new ones and copying, so every resize moves the tensors,
and the decode CUDA graphs, which hold their addresses, must be captured again (about 0.4 s a batch bucket, the
twin's hypothesis; on short runs the captures after a resize cost more than the resize bought). Here an address
never changes: graphs stay valid across resizes, a grow copies nothing and needs only the bytes it adds (no second
copy of a tensor), and a shrink frees memory without allocating. vLLM's sleep mode and SGLang's memory saver map
memory the same way (cuMemCreate + cuMemMap); the binding is NVIDIA's `cuda-bindings` (the `cuda` extra).

Layout: block-major and packed. Block b of every layer's K and V lies at b x block_bytes in the range, so blocks
smaller than the driver's granularity (2 MiB; a SmolLM2 block is about 360 KB) share a granule and the pool maps
the granules its blocks span, wasting less than one granule, where rounding each block up to a granule would ask
for several times the memory it was sized for. Each granule is its own physical allocation, so a shrink unmaps
whole allocations (the driver unmaps nothing smaller than what one cuMemMap mapped). Layer l's K is the strided
view [blocks, block_size, kv_heads, head_dim] that flash-attn's paged kernel reads (it takes any block stride).
The mapped bytes are outside PyTorch's caching allocator, so the probe adds them to what the allocator reports
(CudaProbe's `outside`), where the controller expects the pool.

Lifetime: the range and its granules belong to the tensor that wraps the range. torch keeps the wrapped object
alive as long as any view of the tensor lives (the K and V views, the block views a CUDA graph captured), and
when the last one goes, a finalizer unmaps every granule and frees the range. So a dropped backend gives its
pool back, and a constructor that fails part way releases what it had mapped at once.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.core.kv.tensors import allocate_kv_cache, kv_cache_bytes_per_block
from engine.model.attention_metadata import KVCache

if TYPE_CHECKING:
    from engine.model.model_config import ModelConfig

logger = logging.getLogger("headroom.engine")


class VmmDriver(Protocol):
    """The driver calls the arena needs, so tests can run it over host memory."""

    granularity: int  # bytes: mapping sizes and offsets are multiples of it

    def reserve(self, nbytes: int) -> int:
        """An address range of `nbytes`, nothing mapped."""
        ...

    def free(self, address: int, nbytes: int) -> None:
        """Give back a range `reserve` returned, with nothing mapped in it any more."""
        ...

    def map(self, address: int, nbytes: int) -> object:
        """Physical memory at `address`; the handle to unmap it. torch.OutOfMemoryError when the device has none."""
        ...

    def unmap(self, address: int, nbytes: int, handle: object) -> None: ...

    def tensor(self, address: int, nbytes: int, owner: object) -> torch.Tensor:
        """A uint8 tensor over the range that keeps `owner` alive while any view of it lives. The range's first
        granule must be mapped: torch asks the driver which device owns the address, and the driver knows
        nothing of reserved memory that is not mapped (reading any unmapped part is a fault: the arena never
        does)."""
        ...

    def idle(self) -> None:
        """Return once no kernel queued before can still read the range: what is unmapped must be unused."""
        ...


class _Owner:
    """What the tensor over the range keeps alive; its finalizer releases the range."""


def _unmap_to(driver: VmmDriver, address: int, granules: list[object], keep: int) -> None:
    """Unmap the granules above the first `keep`, last first, once nothing can still read them."""
    if len(granules) > keep:
        driver.idle()
    while len(granules) > keep:
        driver.unmap(address + (len(granules) - 1) * driver.granularity, driver.granularity, granules.pop())


def _release(driver: VmmDriver, address: int, nbytes: int, granules: list[object]) -> None:
    _unmap_to(driver, address, granules, 0)
    driver.free(address, nbytes)


class KVArena:
    def __init__(
        self, driver: VmmDriver, cfg: ModelConfig, block_size: int, dtype: torch.dtype, max_blocks: int, num_blocks: int
    ) -> None:
        self.driver, self.max_blocks = driver, max_blocks
        shape = (cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.block_bytes = dtype.itemsize * cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim
        size = self._granules_for(max_blocks) * driver.granularity
        self.address = driver.reserve(size)
        self.granules: list[object] = []  # the handle of each mapped granule, in address order
        owner = _Owner()
        self._finalizer = weakref.finalize(owner, _release, driver, self.address, size, self.granules)
        self._finalizer.atexit = False  # at exit the process's memory goes back with its context
        self.num_blocks = 0
        try:
            self._map_to(max(1, self._granules_for(num_blocks)))  # before the tensor: see VmmDriver.tensor
            raw = driver.tensor(self.address, size, owner).view(dtype)
            inner = [1]
            for dim in reversed(shape[1:]):
                inner.insert(0, inner[0] * dim)
            self.base = raw.as_strided((max_blocks, *shape), (self.block_bytes // dtype.itemsize, *inner))
            self.resize(num_blocks, {})
        except BaseException:
            self._finalizer()
            raise

    @property
    def mapped_bytes(self) -> int:
        return len(self.granules) * self.driver.granularity

    def caches(self, blocks: int | None = None) -> list[KVCache]:
        """Each layer's (K, V) over the first `blocks` blocks (None: the pool's): views of the same addresses
        whatever the pool's size. A CUDA graph takes views of the whole range (`max_blocks`): the bounds of the
        K and V writes it captures are those of its views, and it must stay valid as the pool grows; only the
        blocks its tables name are ever touched, and those are mapped."""
        n = self.num_blocks if blocks is None else blocks
        return [(self.base[:n, layer, 0], self.base[:n, layer, 1]) for layer in range(self.base.shape[1])]

    def resize(self, num_blocks: int, moves: dict[int, int]) -> None:
        """Copy the blocks in `moves` (old id -> new id, a shrink's compaction), then map the granules a grow
        adds and zero its blocks (slots never written must hold finite values), or unmap the granules a shrink
        frees. A grow the device cannot hold raises torch.OutOfMemoryError with what it mapped unmapped again:
        the pool is as it was."""
        if num_blocks > self.max_blocks:
            raise torch.OutOfMemoryError(f"KV pool of {num_blocks} blocks: the reserved range holds {self.max_blocks}")
        if moves:
            src, dst = (torch.tensor(ids, device=self.base.device) for ids in (list(moves), list(moves.values())))
            self.base.index_copy_(0, dst, self.base.index_select(0, src))
        old, had = self.num_blocks, len(self.granules)
        try:
            self._map_to(self._granules_for(num_blocks))
        except torch.OutOfMemoryError:
            _unmap_to(self.driver, self.address, self.granules, had)
            raise
        self.base[old:num_blocks].zero_()
        self.num_blocks = num_blocks
        _unmap_to(self.driver, self.address, self.granules, max(1, self._granules_for(num_blocks)))  # see tensor()

    def _granules_for(self, blocks: int) -> int:
        return -(-blocks * self.block_bytes // self.driver.granularity)

    def _map_to(self, granules: int) -> None:
        g = self.driver.granularity
        while len(self.granules) < granules:
            self.granules.append(self.driver.map(self.address + len(self.granules) * g, g))


class _CudaArray:
    """The __cuda_array_interface__ torch.as_tensor wraps without a copy; torch keeps it, and so `owner`, alive
    as long as the tensor's storage."""

    def __init__(self, address: int, nbytes: int, owner: object) -> None:
        self.owner = owner
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

    def free(self, address: int, nbytes: int) -> None:
        self._ok(self.cu.cuMemAddressFree(self.cu.CUdeviceptr(address), nbytes), "cuMemAddressFree")

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

    def tensor(self, address: int, nbytes: int, owner: object) -> torch.Tensor:
        return torch.as_tensor(_CudaArray(address, nbytes, owner), device=self.device)

    def idle(self) -> None:
        torch.cuda.synchronize(self.device)


def cuda_vmm(device: torch.device) -> tuple[CudaVmm | None, str]:
    """The driver for `device`, or None, and why: the pool then copies its tensors on a resize. Never raises:
    a binding the driver cannot serve (cuda-bindings 13 needs a CUDA 13 driver, 580 or later, and a 4090 often
    runs a CUDA 12 one) raises on its first call, and the pool must then fall back, not the server fail."""
    if device.type != "cuda":
        return None, "not a CUDA device"
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return None, "cuda-bindings is not installed (the `cuda` extra has it)"
    try:
        return _open_vmm(cu, device)
    except Exception as e:
        return None, f"cuda-bindings could not use the driver ({type(e).__name__}: {e})"


def _open_vmm(cu: Any, device: torch.device) -> tuple[CudaVmm | None, str]:
    bindings = importlib.metadata.version("cuda-bindings")
    err, version = cu.cuDriverGetVersion()
    if err != cu.CUresult.CUDA_SUCCESS:
        return None, f"the driver's version could not be read (error {err})"
    driver_major, bindings_major = version // 1000, int(bindings.split(".")[0])
    if bindings_major > driver_major:
        return None, (
            f"cuda-bindings {bindings} needs a CUDA {bindings_major} driver, and this one is CUDA "
            f"{driver_major}.{version % 1000 // 10} (install cuda-bindings {driver_major}.x)"
        )
    attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    err, supported = cu.cuDeviceGetAttribute(attr, device.index or 0)
    if err != cu.CUresult.CUDA_SUCCESS or not supported:
        return None, "the device does not support CUDA virtual memory management"
    return CudaVmm(cu, device), "CUDA virtual memory: resized in place, graphs kept"


def allocate_pool(
    cfg: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device, num_blocks: int, capacity: int | None
) -> tuple[KVArena | None, list[KVCache], str]:
    """The pool in CUDA virtual memory where the driver has it (resized in place, so the CUDA graphs stay valid),
    else tensors copied on a resize (engine/model/attention.py); and which, and why. On CUDA the fallback is
    logged at WARNING: every resize then costs the graphs' capture again. `capacity`: the device's bytes, where a
    cap stands in for its total (the range is reserved for the largest pool it could hold)."""
    driver, layout = cuda_vmm(device)
    if driver is not None:
        total = torch.cuda.get_device_properties(device).total_memory if capacity is None else capacity
        try:
            arena = KVArena(driver, cfg, block_size, dtype, total // kv_cache_bytes_per_block(cfg, block_size, dtype),
                            num_blocks)  # fmt: skip
            return arena, arena.caches(), layout
        except RuntimeError as e:  # a driver that refuses (OutOfMemoryError is one too)
            layout = f"CUDA virtual memory failed ({e})"
    layout = f"tensors copied on a resize ({layout})"
    if device.type == "cuda":
        _warn_once(f"KV pool: {layout}")
    return None, allocate_kv_cache(cfg, num_blocks, block_size, dtype, device), layout


@functools.cache
def _warn_once(message: str) -> None:
    """One WARNING a process and cause: a process that builds several backends has one cause to read."""
    logger.warning(message)
