"""The KV pool in CUDA virtual memory (engine/model/kv_arena.py), run over host memory by a driver that marks
unmapped bytes with a NaN pattern: a resize keeps every address (so decode graphs stay valid), keeps the blocks'
contents, maps only what it adds, and a grow the device cannot hold leaves the pool as it was. The real driver
(cuda-bindings) runs under bench/device_check.sh on a lent GPU."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from engine.backends import torch_backend
from engine.model.cuda_graphs import DecodeGraphMetadata, Replay
from engine.model.kv_arena import KVArena
from engine.model.model_config import ModelConfig
from telemetry.probes.null import NullProbe
from tests import test_cuda_graphs
from tests.test_cuda_graphs import generate, prompts

tiny = test_cuda_graphs.tiny  # the tiny model fixture, shared with its tests
UNMAPPED = 0xFF  # every float made of these bytes is a NaN


class HostVmm:
    """VmmDriver over one host buffer; fails the `fail_at`-th map (counting from 1) with an OOM."""

    granularity = 4096

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at, self.maps = fail_at, 0
        self.mapped: dict[int, int] = {}
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def reserve(self, nbytes: int) -> int:
        self.buffer = torch.full((nbytes,), UNMAPPED, dtype=torch.uint8)
        return 0

    def map(self, address: int, nbytes: int) -> object:
        self.maps += 1
        if self.maps == self.fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory (cuMemCreate)")
        self.buffer[address : address + nbytes] = 0x7F  # fresh physical memory is not zeroed
        self.mapped[address] = nbytes
        return object()

    def unmap(self, address: int, nbytes: int, handle: object) -> None:
        assert self.mapped.pop(address) == nbytes
        self.buffer[address : address + nbytes] = UNMAPPED

    def tensor(self, address: int, nbytes: int) -> torch.Tensor:
        return self.buffer[address : address + nbytes]


CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=16, max_position_embeddings=256)  # fmt: skip


def arena(driver: HostVmm, num_blocks: int = 4) -> KVArena:
    return KVArena(driver, CFG, 16, torch.float32, 16, num_blocks)


def pointers(a: KVArena) -> list[int]:
    return [t.data_ptr() for kv in a.caches() for t in kv]


def test_a_grow_keeps_every_address_and_every_block_and_zeroes_what_it_adds() -> None:
    a = arena(driver := HostVmm())
    assert a.chunk == 4096 and len(driver.mapped) == 4  # 2 layers x K, V x 16 x 16 x 4 B = 4 KiB a block
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
    assert len(driver.mapped) == 4 and a.mapped_bytes == 4 * a.chunk
    for k, v in a.caches():
        assert [int(k[b, 0, 0, 0]) for b in range(4)] == [0, 6, 2, 7]
        assert [int(v[b, 0, 0, 0]) for b in range(4)] == [0, -6, -2, -7]
    assert (driver.buffer[4 * a.chunk :] == UNMAPPED).all()  # nothing past the pool is mapped


def test_a_grow_the_device_cannot_hold_leaves_the_pool_as_it_was() -> None:
    a = arena(driver := HostVmm(fail_at=7))  # 4 at start, then the third new block fails
    with pytest.raises(torch.OutOfMemoryError):
        a.resize(10, {})
    assert a.num_blocks == 4 and sorted(driver.mapped) == [b * a.chunk for b in range(4)]
    with pytest.raises(torch.OutOfMemoryError):
        a.resize(17, {})  # more than the range reserved for the largest pool


def test_the_backend_keeps_its_graphs_over_a_resize_of_a_pool_in_virtual_memory(tiny, fake_flash, monkeypatch):
    """The torch backend on a pool in (host-emulated) virtual memory: a resize keeps the graphs captured before it,
    which replay over the same addresses, and the tokens are the eager run's."""
    eager_tokens, _ = generate(test_cuda_graphs.backend(tiny), prompts(test_cuda_graphs.backend(tiny), 2), 8)
    monkeypatch.setattr(torch_backend, "cuda_vmm", lambda device: (HostVmm(), "host memory standing in"))
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
    assert b.kv_arena is not None and b.block_bytes == b.kv_arena.chunk
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
    b.graphs = graphs = b.make_decode_graphs(capture)
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
    from engine.model.kv_arena import CudaVmm

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
