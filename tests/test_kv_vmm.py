"""The KV pool in CUDA virtual memory (engine/core/kv/vmm.py), run over host memory by a driver that marks
unmapped bytes with a NaN pattern: a resize keeps every address (so decode graphs stay valid), keeps the blocks'
contents, maps only what it adds, and a grow the device cannot hold leaves the pool as it was. The real driver
(cuda-bindings) runs under bench/device_check.sh on a lent GPU."""

from __future__ import annotations

import gc
import importlib.metadata
import logging
import sys
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.backends import torch_backend
from engine.core.kv import vmm
from engine.core.kv.vmm import KVArena
from engine.model.cuda_graphs import DecodeGraphMetadata, Replay
from engine.model.model_config import ModelConfig
from telemetry.probes.null import NullProbe
from tests import test_cuda_graphs
from tests.test_cuda_graphs import generate, prompts

tiny = test_cuda_graphs.tiny  # the tiny model fixture, shared with its tests
UNMAPPED = 0xFF  # every float made of these bytes is a NaN


class _HostArray:
    """The __array_interface__ numpy wraps without a copy, keeping `owner` alive as CudaVmm's wrapper does."""

    def __init__(self, buffer: torch.Tensor, address: int, nbytes: int, owner: object) -> None:
        self.buffer, self.owner = buffer, owner
        self.__array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (buffer.data_ptr() + address, False), "version": 3,
        }  # fmt: skip


class HostVmm:
    """VmmDriver over one host buffer; fails the `fail_at`-th map (counting from 1) with an OOM. Like torch over
    the CUDA driver, it cannot wrap a range whose first granule is not mapped."""

    def __init__(self, fail_at: int | None = None, granularity: int = 4096) -> None:
        self.fail_at, self.maps, self.granularity = fail_at, 0, granularity
        self.mapped: dict[int, int] = {}
        self.reserved: dict[int, int] = {}
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def reserve(self, nbytes: int) -> int:
        self.buffer = torch.full((nbytes,), UNMAPPED, dtype=torch.uint8)
        self.reserved[0] = nbytes
        return 0

    def free(self, address: int, nbytes: int) -> None:
        assert not self.mapped and self.reserved.pop(address) == nbytes

    def map(self, address: int, nbytes: int) -> object:
        self.maps += 1
        if self.maps == self.fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory (cuMemCreate)")
        assert nbytes == self.granularity and address % self.granularity == 0 and address not in self.mapped
        self.buffer[address : address + nbytes] = 0x7F  # fresh physical memory is not zeroed
        self.mapped[address] = nbytes
        return object()

    def unmap(self, address: int, nbytes: int, handle: object) -> None:
        assert self.mapped.pop(address) == nbytes
        self.buffer[address : address + nbytes] = UNMAPPED

    def tensor(self, address: int, nbytes: int, owner: object) -> torch.Tensor:
        if address not in self.mapped:  # torch's cudaPointerGetAttributes on reserved, unmapped memory
            raise RuntimeError("CUDA error: invalid argument (the driver knows no device for this address)")
        return torch.from_numpy(np.asarray(_HostArray(self.buffer, address, nbytes, owner)))

    def idle(self) -> None:
        """Nothing runs asynchronously on the host."""


CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=16, max_position_embeddings=256)  # fmt: skip


def arena(driver: HostVmm, num_blocks: int = 4) -> KVArena:
    return KVArena(driver, CFG, 16, torch.float32, 16, num_blocks)


def pointers(a: KVArena) -> list[int]:
    return [t.data_ptr() for kv in a.caches() for t in kv]


def test_a_grow_keeps_every_address_and_every_block_and_zeroes_what_it_adds() -> None:
    a = arena(driver := HostVmm())
    assert a.block_bytes == 4096 and len(driver.mapped) == 4  # 2 layers x K, V x 16 x 16 x 4 B = 4 KiB a block
    before = pointers(a)
    for layer, (k, v) in enumerate(a.caches()):
        k.fill_(layer + 1.0)
        v.fill_(-layer - 1.0)
    a.resize(10, {})
    assert pointers(a) == before and len(driver.mapped) == 10
    for layer, (k, v) in enumerate(a.caches()):
        assert k.shape == (10, 16, 1, 16) and k.stride(-1) == 1
        assert (k[:4] == layer + 1).all() and (v[:4] == -layer - 1).all()
        assert (k[4:] == 0).all() and (v[4:] == 0).all()


def test_a_shrink_moves_kept_blocks_down_and_unmaps_the_rest() -> None:
    a = arena(driver := HostVmm(), 8)
    for b in range(8):
        for k, v in a.caches():
            k[b], v[b] = b, -b
    a.resize(4, {6: 1, 7: 3})
    assert len(driver.mapped) == 4 and a.mapped_bytes == 4 * a.block_bytes
    for k, v in a.caches():
        assert [int(k[b, 0, 0, 0]) for b in range(4)] == [0, 6, 2, 7]
        assert [int(v[b, 0, 0, 0]) for b in range(4)] == [0, -6, -2, -7]
    assert (driver.buffer[4 * a.block_bytes :] == UNMAPPED).all()  # nothing past the pool is mapped


def test_a_grow_the_device_cannot_hold_leaves_the_pool_as_it_was() -> None:
    a = arena(driver := HostVmm(fail_at=7))  # 4 at start, then the third new block fails
    with pytest.raises(torch.OutOfMemoryError):
        a.resize(10, {})
    assert a.num_blocks == 4 and sorted(driver.mapped) == [b * a.block_bytes for b in range(4)]
    with pytest.raises(torch.OutOfMemoryError):
        a.resize(17, {})  # more than the range reserved for the largest pool


def test_blocks_smaller_than_a_granule_share_one() -> None:
    """A block of 4 KiB in granules of 16 KiB: the pool maps the granules its blocks span, not a granule a block."""
    a = arena(driver := HostVmm(granularity=16384), 5)
    assert a.block_bytes == 4096 and sorted(driver.mapped) == [0, 16384] and a.mapped_bytes == 32768
    k, _ = a.caches()[0]
    assert k.stride(0) * k.element_size() == 4096  # packed: block b at b x 4 KiB
    for b in range(5):
        k[b] = b
    a.resize(9, {})  # 36 KiB: a third granule
    assert (
        len(driver.mapped) == 3 and [int(a.caches()[0][0][b, 0, 0, 0]) for b in range(9)] == [0, 1, 2, 3, 4] + [0] * 4
    )
    a.resize(4, {})  # 16 KiB: one granule
    assert sorted(driver.mapped) == [0] and (driver.buffer[16384:] == UNMAPPED).all()


def test_the_range_is_released_when_the_last_view_of_the_pool_is_dropped() -> None:
    a = arena(driver := HostVmm(), 6)
    caches = a.caches()
    del a
    gc.collect()
    assert len(driver.mapped) == 6  # the views still read the pool
    del caches
    gc.collect()
    assert not driver.mapped and not driver.reserved


def test_a_constructor_that_fails_part_way_releases_what_it_mapped() -> None:
    driver = HostVmm(fail_at=3)
    with pytest.raises(torch.OutOfMemoryError):
        arena(driver, 6)
    assert not driver.mapped and not driver.reserved


def test_the_backend_keeps_its_graphs_over_a_resize_of_a_pool_in_virtual_memory(tiny, fake_flash, monkeypatch):
    """The torch backend on a pool in (host-emulated) virtual memory: a resize keeps the graphs captured before it,
    which replay over the same addresses, and the tokens are the eager run's."""
    eager_tokens, _ = generate(test_cuda_graphs.backend(tiny), prompts(test_cuda_graphs.backend(tiny), 2), 8)
    monkeypatch.setattr(vmm, "cuda_vmm", lambda device: (HostVmm(), "host memory standing in"))
    b = torch_backend.TorchBackend(
        str(tiny.hf_dir),
        dtype="float32",
        device="cpu",
        num_blocks=8,
        block_size=256,
        device_memory="64MiB",
        attention="sdpa",  # the C++ kernel reads a contiguous pool; a pool in virtual memory is on CUDA only
        probe=NullProbe(),  # the CPU probe would count the host buffer standing in for device memory
    )
    assert b.kv_arena is not None and b.block_bytes == b.kv_arena.block_bytes
    captured: list[list[int]] = []

    def capture(fn: Callable[[], torch.Tensor]) -> Replay:
        captured.append(pointers(b.kv_arena))
        fn()
        return fn

    seen: list[int] = []  # pool blocks the graph path's K/V views span
    model = b.model

    class Spy:
        def __call__(self, ids, positions, caches, meta):  # noqa: ANN001, ANN204
            if isinstance(meta, DecodeGraphMetadata):
                seen.append(caches[0][0].shape[0])
            return model(ids, positions, caches, meta)

        def __getattr__(self, name: str) -> object:
            return getattr(model, name)

    b.model = Spy()
    b.graphs = graphs = b.make_decode_graphs(capture, "flash_decode")
    _, engine = generate(b, prompts(b, 2), max_tokens=3)
    engine.resize_kv_pool(12)
    assert not graphs.disabled
    assert b.num_blocks == 12 and b.graphs is graphs and graphs.replays  # kept
    tokens, _ = generate(b, prompts(b, 2), max_tokens=8)
    assert tokens == eager_tokens
    assert len(captured) == 1 and captured[0] == pointers(b.kv_arena)  # bucket 2, captured once
    # the graph's views span the whole reserved range, so the K/V writes it captured stay in bounds as it grows
    assert set(seen) == {b.kv_arena.max_blocks} and b.kv_arena.max_blocks > b.num_blocks


class FakeDriverApi:
    """cuda.bindings.driver's surface CudaVmm uses: results as (CUresult, *values) tuples, calls recorded."""

    class CUresult:
        CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_INVALID_VALUE = 0, 2, 1

    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED="pinned")
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE="device")
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM="minimum")
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE="rw")

    def __init__(self, create: int = 0, map_: int = 0) -> None:
        self.calls: list[str] = []
        self.create, self.map_ = create, map_  # the CUresult cuMemCreate / cuMemMap return

    def CUmemAllocationProp(self) -> SimpleNamespace:  # noqa: N802 - the binding's names
        return SimpleNamespace(type=None, location=SimpleNamespace(type=None, id=None))

    def CUmemAccessDesc(self) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(location=None, flags=None)

    def CUdeviceptr(self, address: int) -> int:  # noqa: N802
        return address

    def __getattr__(self, name: str) -> Callable:
        results = {"cuMemGetAllocationGranularity": (0, 2 << 20), "cuMemAddressReserve": (0, 1 << 40),
                   "cuMemCreate": (self.create, "handle"), "cuMemMap": (self.map_,)}  # fmt: skip

        def call(*args: object) -> tuple:
            self.calls.append(name)
            return results.get(name, (0,))

        return call


def test_the_cuda_driver_maps_creates_then_maps_and_grants_access_and_undoes_a_failed_map() -> None:
    from engine.core.kv.vmm import CudaVmm

    api = FakeDriverApi()
    vmm = CudaVmm(api, torch.device("cuda", 0))
    assert vmm.granularity == 2 << 20 and vmm.reserve(1 << 30) == 1 << 40
    assert vmm.map(1 << 40, 2 << 20) == "handle"
    assert api.calls[-3:] == ["cuMemCreate", "cuMemMap", "cuMemSetAccess"]
    vmm.unmap(1 << 40, 2 << 20, "handle")
    assert api.calls[-2:] == ["cuMemUnmap", "cuMemRelease"]
    with pytest.raises(torch.OutOfMemoryError):
        CudaVmm(FakeDriverApi(create=2), torch.device("cuda", 0)).map(0, 2 << 20)
    failing = FakeDriverApi(map_=1)
    with pytest.raises(RuntimeError, match="cuMemMap"):
        CudaVmm(failing, torch.device("cuda", 0)).map(0, 2 << 20)
    assert failing.calls[-2:] == ["cuMemUnmap", "cuMemRelease"]  # the handle is not leaked


class FakeBindings(SimpleNamespace):
    """cuda.bindings.driver's start-up calls: the driver's CUDA version, and a device attribute that may raise
    as a binding built for a newer driver does."""

    CUresult = FakeDriverApi.CUresult
    CUdevice_attribute = SimpleNamespace(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED="vmm")

    def __init__(self, driver_version: int, attribute: Callable[..., tuple]) -> None:
        super().__init__(cuDriverGetVersion=lambda: (0, driver_version), cuDeviceGetAttribute=attribute)


def bindings(monkeypatch: pytest.MonkeyPatch, api: FakeBindings, version: str) -> None:
    package = SimpleNamespace(driver=api)
    monkeypatch.setitem(sys.modules, "cuda", SimpleNamespace(bindings=package))
    monkeypatch.setitem(sys.modules, "cuda.bindings", package)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", api)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version if name == "cuda-bindings" else real(name))


def test_a_binding_the_driver_cannot_serve_falls_back_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda-bindings 13 on a CUDA 12 driver (a common 4090 set-up): the copying pool, and why; a binding call that
    raises is a reason too, never an exception out of the backend's start-up."""
    from engine.core.kv.vmm import cuda_vmm

    def raising(*_args: object) -> tuple:
        raise RuntimeError("Function cuDeviceGetAttribute not found")

    device = torch.device("cuda", 0)
    bindings(monkeypatch, FakeBindings(12040, lambda *_a: (0, 1)), "13.5.0")
    driver, why = cuda_vmm(device)
    assert driver is None and "cuda-bindings 13.5.0 needs a CUDA 13 driver" in why and "CUDA 12.4" in why
    bindings(monkeypatch, FakeBindings(13000, raising), "13.5.0")
    driver, why = cuda_vmm(device)
    assert driver is None and "Function cuDeviceGetAttribute not found" in why
    bindings(monkeypatch, FakeBindings(13000, lambda *_a: (0, 0)), "13.0.2")
    assert cuda_vmm(device) == (None, "the device does not support CUDA virtual memory management")


def test_a_cuda_pool_that_cannot_be_in_virtual_memory_says_why_once_at_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The copying pool on CUDA costs every bucket's graph capture again after each resize: the reason is logged
    at WARNING, once a process however many backends it builds, and returned as the layout (/controller/state)."""
    monkeypatch.setattr(vmm, "cuda_vmm", lambda device: (None, "cuda-bindings is not installed"))
    monkeypatch.setattr(vmm, "allocate_kv_cache", lambda *args: [])
    vmm._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="headroom.engine"):
        pools = [vmm.allocate_pool(CFG, 16, torch.bfloat16, torch.device("cuda", 0), 4, None) for _ in range(2)]
    layout = "tensors copied on a resize (cuda-bindings is not installed)"
    assert pools == [(None, [], layout)] * 2
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [f"KV pool: {layout}"]


@pytest.mark.cuda
def test_the_pool_on_a_real_card_is_in_virtual_memory_packs_its_blocks_and_gives_them_back() -> None:
    """The real driver (cuda-bindings): the range is wrapped once its first granule is mapped, blocks of a
    quarter granule share granules, a grow keeps the addresses and the contents, and dropping the pool gives
    every byte back to the driver."""
    from engine.core.kv.vmm import cuda_vmm

    device = torch.device("cuda", 0)
    driver, why = cuda_vmm(device)
    assert driver is not None, why
    granule = driver.granularity
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=64, max_position_embeddings=4096)  # fmt: skip
    block_size = granule // (4 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2)  # a quarter granule
    a = KVArena(driver, cfg, block_size, torch.bfloat16, 4096, 6)
    assert a.block_bytes * 4 == granule and a.mapped_bytes == 2 * granule
    k, v = a.caches()[1]
    k.fill_(1.5)
    v.fill_(-2.0)
    before = pointers(a)
    a.resize(9, {})
    assert pointers(a) == before and a.mapped_bytes == 3 * granule
    k, v = a.caches()[1]
    assert (k[:6] == 1.5).all() and (v[:6] == -2.0).all() and (k[6:] == 0).all()
    a.resize(2, {5: 1})
    assert a.mapped_bytes == granule and (a.caches()[1][0][:2] == 1.5).all()
    # what the drop gives back is what the pool mapped (measured across the drop alone: the first use of each op
    # above loaded its kernels' code into device memory, which stays)
    mapped = a.mapped_bytes
    gc.collect()  # earlier tests' garbage, which the collection below would free too
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.mem_get_info(device)[0]
    del a, k, v
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.mem_get_info(device)[0] - held == mapped
