"""The twin's memory model: the caching-allocator rules it relies on, the idle footprint (F1), and what its
probe reports (the same fields and meanings as the CUDA probe)."""

from __future__ import annotations

import pytest
import torch

from engine.backends.twin.allocator import CachingAllocator, DeviceOOM, segment_size
from engine.backends.twin.backend import TwinBackend
from engine.backends.twin.memo import LRUMemo
from engine.backends.twin.memory import MEMO_SIZE, MemoryModel, StepMemory
from engine.backends.twin.profile import load_profile
from engine.core.batch import ScheduledItem, SchedulerOutput
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from telemetry.units import MIB

PROFILE = load_profile()
LOGITS_4096 = 4096 * 128256 * 4  # fp32 logits of a 4096-token prompt


def test_segment_sizes_follow_the_cuda_caching_allocator():
    assert segment_size(512 * 1024) == 2 * MIB  # small pool
    assert segment_size(3 * MIB) == 20 * MIB  # < 10 MiB: one 20 MiB segment
    assert segment_size(11 * MIB + 1) == 12 * MIB  # rounded up to 2 MiB


def test_best_fit_split_merge():
    a = CachingAllocator(limit=1000 * MIB)
    a.malloc("big", 100 * MIB)
    a.free("big")
    a.malloc("x", 30 * MIB)  # reuses the cached segment, split: no new cudaMalloc
    assert a.reserved == 100 * MIB and a.allocated == 30 * MIB
    a.malloc("y", 60 * MIB)
    assert a.reserved == 100 * MIB
    a.free("x")
    a.free("y")  # merges back into one free block
    a.malloc("z", 100 * MIB)
    assert a.reserved == 100 * MIB and a.peak_allocated == 100 * MIB


def test_flush_and_retry_then_oom():
    a = CachingAllocator(limit=300 * MIB)
    a.malloc("p", 200 * MIB)
    a.free("p")
    a.malloc("q", 250 * MIB)  # no cached block fits, cudaMalloc fails, flush frees p's segment, retry works
    assert a.retries == 1 and a.reserved == 250 * MIB
    a.malloc("pin", 40 * MIB)
    with pytest.raises(DeviceOOM):
        a.malloc("r", 40 * MIB)  # 250 + 40 + 40 > 300 and nothing is wholly free
    assert a.retries == 2


def test_a_small_block_without_a_segment_leaves_no_phantom_segment():
    a = CachingAllocator(limit=2 * MIB)
    a.malloc("s1", MIB)
    a.malloc("s2", MIB)  # the small pool's one 2 MiB segment is full
    with pytest.raises(DeviceOOM):
        a.malloc("s3", 512 * 1024)  # its segment cannot be had, even after the flush
    assert a.small_live == 2 * MIB and a.reserved == 2 * MIB <= a.limit
    # The same in a step: another process holds every free byte, a 1-row decode fails on its logits.
    m = MemoryModel(PROFILE, num_blocks=64, block_size=256)
    m.set_external(m.driver_free)
    assert m.run_step(StepMemory(1, 1, 0)).oom is not None
    assert m.driver_free == 0 and m.reserved == 0


def test_a_pinned_segment_cannot_be_reused_for_a_bigger_tensor():
    # Fragmentation after a shape change: a small long-lived tensor inside a cached big block.
    a = CachingAllocator(limit=250 * MIB)
    a.malloc("logits", 200 * MIB)
    a.free("logits")
    a.malloc("held", 12 * MIB)  # best fit: lands in the 200 MiB block
    with pytest.raises(DeviceOOM):
        a.malloc("logits2", 200 * MIB)


@pytest.mark.parametrize("n", [64, 80, 96])
def test_f1_idle_device_memory(n):
    b = TwinBackend(num_blocks=n, sensors="ideal")  # the fact's own: no graph pool beside the seed's idle
    used_mib = b.probe.sample().device_used / MIB
    assert used_mib == pytest.approx(19515 + 32 * n, abs=1)
    assert b.memory.idle_nvml_used == b.probe.sample().device_used


def _prefill(prompt_len: int, max_tokens: int = 8, rid: str = "a") -> SchedulerOutput:
    seq = Sequence(rid, [7] * prompt_len, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)
    batch = SchedulerOutput()
    batch.add(ScheduledItem.of(seq, 0, prompt_len, is_prefill=True))
    return batch


def test_probe_reports_what_cuda_and_nvml_would():
    b = TwinBackend(num_blocks=64, sensors="ideal")  # exact bytes every step
    with b.probe.step(_prefill(4096).shape):
        (tok,) = b.execute(_prefill(4096)).sampled
    s = b.probe.sample()
    assert tok not in b.eos_token_ids
    assert s.capacity == 25_250_627_584 and s.device_total == 25_757_220_864
    ws = PROFILE.section("memory")["prefill_seq_workspace_bytes"]
    assert s.idle_baseline == b.memory.persistent
    assert s.step_peak >= LOGITS_4096 + ws
    assert s.reserved >= s.peak_allocated
    assert s.device_used == b.memory.context + s.reserved  # the cache keeps what the step reserved
    # The retained logits are allocated while no step runs: the next step's idle baseline includes them.
    with b.probe.step(_prefill(32, rid="b").shape):
        b.execute(_prefill(32, rid="b"))
    assert b.probe.sample().idle_baseline >= b.memory.persistent + LOGITS_4096


def test_oom_raises_torch_error_and_keeps_counting():
    b = TwinBackend(num_blocks=80, sensors="ideal")  # F2's OOM, on the fact's own sensors
    with pytest.raises(torch.OutOfMemoryError), b.probe.step(_prefill(4096).shape):
        b.execute(_prefill(4096))
    s = b.probe.sample()
    assert s.ooms == 1 and s.alloc_retries >= 1
    t = b.now()
    assert t > 0  # the failed step still took time
    reserved = b.memory.reserved
    b.recover_from_oom()  # the cache stays this process's, for the step run again (recover_from_oom)
    assert b.memory.reserved == reserved and b.memory.allocated == 0
    b.memory.empty_cache()  # torch.cuda.empty_cache(): nothing of the failed step stays reserved
    assert b.memory.reserved <= 2 * MIB


def test_retained_output_makes_back_to_back_long_prefills_fail():
    m = MemoryModel(PROFILE, num_blocks=64, block_size=256)
    assert m.run_step(StepMemory(4096, 1, 1)).oom is None
    assert m.run_step(StepMemory(4096, 1, 1)).oom is not None  # F7's mechanism
    m2 = MemoryModel(PROFILE, num_blocks=64, block_size=256)
    m2.run_step(StepMemory(4096, 1, 1))
    m2.run_step(StepMemory(1, 1, 0))  # a decode in between drops the 2 GiB of logits
    assert m2.run_step(StepMemory(4096, 1, 1)).oom is None


def test_block_sizes():
    assert TwinBackend(num_blocks=64).block_size == 256
    assert TwinBackend(num_blocks=1024, block_size=16).block_size == 16  # vLLM-like replays
    TwinBackend(num_blocks=32, block_size=512)
    with pytest.raises(ValueError, match="256"):
        TwinBackend(num_blocks=128, block_size=128)  # fact: flash-attn paged KV needs multiples of 256


def test_memoized_steps_match_fresh_replays():
    m = MemoryModel(PROFILE, num_blocks=64, block_size=256)
    shapes = [
        StepMemory(2048, 8, 8),
        StepMemory(8, 8, 0),
        StepMemory(8, 8, 0),
        StepMemory(256, 1, 1),
        StepMemory(24, 24, 0),
    ] * 3
    results = [m.run_step(s) for s in shapes]
    m2 = MemoryModel(PROFILE, num_blocks=64, block_size=256)
    for s, r in zip(shapes, results, strict=True):
        m2._memo.clear()
        assert m2.run_step(s) == r


def test_memos_are_bounded_and_forgetting_changes_no_result():
    """issue #13: a long-running twin server must not grow its memos without bound. A model with 4-entry
    memos replays a long varied run exactly like one that remembers everything."""
    shapes = [StepMemory(rows, min(rows, 8), p) for rows in (1, 8, 64, 300, 2048, 4096) for p in (0, 1, 4)]
    run = [shapes[(i * 7) % len(shapes)] for i in range(200)]
    small = MemoryModel(PROFILE, num_blocks=64, block_size=256, memo_size=4)
    big = MemoryModel(PROFILE, num_blocks=64, block_size=256)
    for s in run:
        assert small.run_step(s) == big.run_step(s)
        assert small.reserved == big.reserved and small.state == big.state
        if small.ooms != big.ooms:
            raise AssertionError("OOM counts diverged")
    assert big.ooms > 0  # the run reaches the allocator's failure path too
    assert len(small._memo) <= 4 and len(small._states) <= 4 and len(small._state_ids) <= 4
    assert len(big._memo) > 4


def test_lru_memo_drops_the_least_recently_used():
    memo = LRUMemo(2)
    memo.put("a", 1)
    memo.put("b", 2)
    assert memo.get("a") == 1  # a is now the newest
    memo.put("c", 3)
    assert memo.get("b") is None and memo.get("a") == 1 and memo.get("c") == 3 and len(memo) == 2
    with pytest.raises(ValueError):
        LRUMemo(0)


def test_backend_sample_and_decode_memos_are_lru_memos():
    b = TwinBackend(num_blocks=64)
    assert isinstance(b._samples, LRUMemo) and b._samples.maxsize == MEMO_SIZE
    assert isinstance(b.latency._dec_const, LRUMemo)
