"""The resizable KV pool (issue #15, step 1): the allocator's plans, the engine applying them between steps
without changing a token, and the twin charging a resize its memory and time."""

from __future__ import annotations

import pytest
import torch

from engine.backends.twin.backend import TwinBackend
from engine.baselines.seed import FixedPolicy
from engine.core.kv.blocks import BlockAllocator
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from telemetry.units import MIB
from tests.fake_backend import FakeBackend


def test_grow_adds_free_blocks_handed_out_last():
    a = BlockAllocator(4, 16)
    used = a.allocate(3)
    plan = a.plan_resize(8)
    assert (plan.num_blocks, plan.moves, a.num_blocks) == (8, {}, 4)  # planning changes nothing
    a.apply(plan)
    assert (a.num_blocks, a.num_used, a.num_free) == (8, 3, 5)
    assert a.allocate(2) == [3, 4]  # the old free block first, then the new ones in order
    a.free(used)


def test_shrink_gives_back_free_blocks_and_moves_used_ones_down():
    a = BlockAllocator(10, 16)
    blocks = a.allocate(10)
    a.free([b for b in blocks if b not in (1, 7, 9)])  # in use: 1, 7, 9
    plan = a.plan_resize(4)
    assert plan.num_blocks == 4
    assert plan.moves == {7: 0, 9: 2}  # into the lowest free ids below the new size
    a.apply(plan)
    assert (a.num_blocks, a.num_used, a.num_free) == (4, 3, 1)
    assert a.allocate(1) == [3]


def test_shrink_never_goes_below_blocks_in_use():
    a = BlockAllocator(8, 16)
    a.allocate(5)
    plan = a.plan_resize(2)
    assert plan.num_blocks == 5 and plan.moves == {}
    a.apply(plan)
    assert a.num_free == 0
    with pytest.raises(ValueError, match="stale"):
        a.apply(plan.__class__(3, 8))


def _run(engine: LLMEngine, prompts: list[list[int]], resize_every: int = 0, sizes: tuple[int, ...] = ()) -> list:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    step = 0
    while engine.has_unfinished():
        engine.step()
        step += 1
        if resize_every and step % resize_every == 0:
            engine.resize_kv_pool(sizes[(step // resize_every) % len(sizes)])
    return [s.output_ids for s in seqs]


def test_engine_resizes_between_steps_without_changing_a_token():
    """The fake backend derives each token from the KV it reads back through the block tables, so a block
    moved without its contents, or a table not rewritten, changes the output."""
    prompts = [[3 + i + j for j in range(5 + 3 * i)] for i in range(6)]
    ref = _run(LLMEngine(FakeBackend(num_blocks=64), FixedPolicy()), prompts)
    engine = LLMEngine(FakeBackend(num_blocks=64), FixedPolicy())
    moved = []
    real_resize = engine.backend.resize_kv
    engine.backend.resize_kv = lambda plan: moved.append(len(plan.moves)) or real_resize(plan)
    assert _run(engine, prompts, resize_every=3, sizes=(96, 40, 128, 36)) == ref
    assert sum(moved) > 0, "no shrink moved a block: the test did not exercise compaction"
    assert engine.allocator.num_used == 0


def test_engine_keeps_room_for_the_longest_admitted_request():
    engine = LLMEngine(FakeBackend(num_blocks=64, block_size=4), FixedPolicy())
    engine.add_request("long", list(range(1, 41)), SamplingParams(max_tokens=40, ignore_eos=True))
    plan = engine.resize_kv_pool(4)
    assert plan is not None and plan.num_blocks == 20  # (40 + 40) / 4 blocks, not 4
    assert engine.resize_kv_pool(20) is None


def test_twin_resize_moves_the_limit_and_charges_the_mapping():
    b = TwinBackend(num_blocks=64)
    m = b.memory
    limit, persistent, t0 = m.limit, m.persistent, b.now()
    engine = LLMEngine(b, FixedPolicy())
    plan = engine.resize_kv_pool(96)
    grown = 32 * m.block_bytes
    assert m.persistent == persistent + grown and m.limit == limit - grown
    assert b.probe.idle_bytes == m.persistent
    # a step that never reaches the device next (an injected OOM) reports the grown pool, as a real probe would
    assert b.probe.sample().reserved >= m.persistent and b.probe.sample().idle_baseline >= m.persistent
    # in place (engine/core/kv/vmm.py): 32 new blocks (1 GiB) zeroed at 950 GB/s, 32 maps of 100 us
    cost = b.now() - t0
    assert cost == pytest.approx(32 * m.block_bytes / 950e9 + 32 * 1e-4)
    assert cost == b.resize_cost(plan)
    engine.resize_kv_pool(64)
    assert m.limit == limit


def test_twin_resize_that_does_not_fit_raises_and_changes_nothing():
    b = TwinBackend(num_blocks=64)
    engine = LLMEngine(b, FixedPolicy())
    free_blocks = b.memory.driver_free // b.memory.block_bytes
    with pytest.raises(torch.OutOfMemoryError):
        engine.resize_kv_pool(64 + free_blocks + 1)
    assert (b.num_blocks, engine.allocator.num_blocks, b.memory.num_blocks) == (64, 64, 64)
    assert engine.resize_kv_pool(64 + free_blocks) is not None  # in place: the growth alone, no transient


def test_twin_shrink_with_no_free_memory_goes_through():
    """Another process holds every free byte: a shrink still goes through (it allocates nothing), a grow raises."""
    b = TwinBackend(num_blocks=64)
    engine = LLMEngine(b, FixedPolicy())
    b.set_external(b.memory.driver_free)
    assert b.memory.driver_free == 0
    with pytest.raises(torch.OutOfMemoryError):
        engine.resize_kv_pool(65)
    t0 = b.now()
    plan = engine.resize_kv_pool(32)
    assert b.memory.num_blocks == engine.allocator.num_blocks == 32
    assert b.now() - t0 == pytest.approx(b.resize_cost(plan)) == pytest.approx(32 * 1e-4)


def test_torch_shrink_with_no_device_memory_stages_through_the_host(monkeypatch):
    """The CUDA shrink with fakes: the first new tensor cannot be allocated on the device, so its kept
    blocks go to the host and back after the old tensor is dropped; every block kept is intact."""
    from engine.core.kv import tensors

    calls = []
    real = tensors.zeroed_kv_tensor

    def zeroed_oom_once(shape, dtype, device):
        calls.append(shape)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("no device memory")
        return real(shape, dtype, device)

    monkeypatch.setattr(tensors, "zeroed_kv_tensor", zeroed_oom_once)
    layers = [(torch.arange(24.0).view(6, 2, 2), -torch.arange(24.0).view(6, 2, 2)) for _ in range(2)]
    caches = [(k.clone(), v.clone()) for k, v in layers]
    tensors.resize_kv_cache(caches, 3, {5: 1})
    assert calls == [(3, 2, 2)] * 5  # the failed one, its staged retry, and the other three tensors
    for (k, v), (k0, v0) in zip(caches, layers, strict=True):
        assert k.shape == v.shape == (3, 2, 2)
        assert torch.equal(k[1], k0[5]) and torch.equal(k[2], k0[2]) and torch.equal(v[0], v0[0])


def test_twin_external_memory_takes_only_what_is_free():
    b = TwinBackend(num_blocks=64, sensors="ideal")  # no graph pool in device_used
    m = b.memory
    free = m.driver_free
    assert m.set_external(4096 * MIB) == min(4096 * MIB, free)
    assert m.limit + m.external == m.cuda_total - m.context - m.persistent
    assert m.device_used() == m.context + m.persistent + m.reserved + m.external
    assert m.set_external(0) == 0


def test_torch_resize_on_cuda_path_keeps_one_tensor_per_layer_and_empties_the_cache(monkeypatch):
    """The CUDA mechanism with fakes (no GPU here): a new tensor per K and V per layer, the kept and moved
    blocks copied, the rest zeroed, then torch.cuda.empty_cache so the old tensors go back to the driver."""
    from engine.backends.torch_backend import TorchBackend
    from engine.core.kv.blocks import ResizePlan
    from telemetry.probes.null import NullProbe

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    b = object.__new__(type("EightByteBlocks", (TorchBackend,), {"block_bytes": 8}))
    b.device, b.num_blocks, b.probe = torch.device("cuda"), 6, NullProbe(idle_bytes=48)
    layers = [(torch.arange(24.0).view(6, 2, 2), -torch.arange(24.0).view(6, 2, 2)) for _ in range(3)]
    b.kv_caches = [(k.clone(), v.clone()) for k, v in layers]
    b.resize_kv(ResizePlan(3, 6, {5: 1}))
    assert emptied == [True] and b.num_blocks == 3 and b.probe.idle_bytes == 24
    for (k, v), (k0, v0) in zip(b.kv_caches, layers, strict=True):
        assert k.shape == (3, 2, 2) and v.shape == (3, 2, 2)
        assert torch.equal(k[1], k0[5]) and torch.equal(v[0], v0[0]) and torch.equal(k[2], k0[2])
    b.resize_kv(ResizePlan(5, 3))
    assert b.kv_caches[0][0].shape[0] == 5 and not b.kv_caches[0][0][3:].any()
