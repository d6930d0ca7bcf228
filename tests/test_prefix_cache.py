"""Automatic prefix caching: the allocator's reference counts, hash index and LRU eviction; hits at
admission on the model-free backend (which reads every token back through the block tables, so a wrong hit
changes the output); and the KV accounting, exact after every step of mixed traffic with sharing,
preemption, aborts and resizes."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine.baselines.seed import FixedPolicy
from engine.core.kv.blocks import BlockAllocator
from engine.core.kv.prefix_cache import ROOT_HASH, hash_block
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from tests.fake_backend import FakeBackend

H = [hash_block(ROOT_HASH, [i]) for i in range(8)]  # stand-in block hashes for the allocator tests


def vllm_like(**caps) -> FixedPolicy:
    return FixedPolicy(kv_reserve_ratio=0.0, allow_mixed=True, prefill_first=False, max_num_seqs=256, **caps)


def params(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def finish(engine: LLMEngine, prompt: list[int], max_tokens: int = 6, rid: str = "r") -> list[int]:
    seq = engine.add_request(rid, prompt, params(max_tokens))
    while engine.has_unfinished():
        engine.step()
    return seq.output_ids


def check_accounting(engine: LLMEngine) -> None:
    """Exact KV accounting: every block is in use (held by the running tables, as many times as its reference
    count says), never-cached free, or evictable (free and cached); the hash index is one to one."""
    a = engine.allocator
    held = Counter(b for seq in engine.scheduler.running for b in seq.block_table)
    assert all(not seq.block_table for seq in engine.scheduler.waiting)
    free, evictable = set(a._free), set(a._evictable)
    assert len(free) == len(a._free) and not free & evictable and not (free | evictable) & held.keys()
    assert a.num_used == len(held) and a.num_used + a.num_free == a.num_blocks
    assert free | evictable | held.keys() == set(range(a.num_blocks))
    assert [a._refs[b] for b in range(a.num_blocks)] == [held[b] for b in range(a.num_blocks)]
    assert {b: h for h, b in a._block_of.items()} == a._hash_of and evictable <= a._hash_of.keys()


def test_freed_cached_blocks_stay_findable_and_count_as_free():
    a = BlockAllocator(4, 16)
    blocks = a.allocate(3)
    for b, h in zip(blocks, H, strict=False):
        a.cache(b, h)
    a.free(blocks)
    assert (a.num_used, a.num_free, a.num_cached) == (0, 4, 3)
    assert a.lookup([H[0], H[1], H[5], H[2]]) == blocks[:2]  # the run stops at the first miss
    assert a.num_evictable(blocks[:2]) == 2
    a.share(blocks[:2])
    assert (a.num_used, a.num_free) == (2, 2)
    a.share(blocks[:1])  # a second table holds the first block
    a.free(blocks[:2])
    a.free(blocks[:1])
    assert a.num_used == 0
    with pytest.raises(AssertionError, match="freed twice"):
        a.free(blocks[:1])


def test_allocation_takes_never_cached_blocks_then_evicts_least_recently_used():
    a = BlockAllocator(4, 16)
    blocks = a.allocate(4)
    for b, h in zip(blocks[:3], H, strict=False):
        a.cache(b, h)
    a.free([blocks[2]])
    a.free(blocks[:2])  # a table's last block is freed first: LRU order 2, 1, 0
    a.free([blocks[3]])  # never cached
    assert a.allocate(1) == [blocks[3]] and a.num_cached == 3
    assert a.allocate(2) == [blocks[2], blocks[1]]
    assert a.lookup([H[0], H[1]]) == [blocks[0]] and a.num_cached == 1  # evicted blocks lose their hash
    with pytest.raises(MemoryError):
        a.allocate(2)


def test_a_hash_keeps_its_first_block():
    a = BlockAllocator(4, 16)
    first, second = a.allocate(2)
    a.cache(first, H[0])
    a.cache(second, H[0])  # the same prefix computed twice at once
    assert a.lookup([H[0]]) == [first] and a.num_cached == 1


def test_shrink_evicts_free_cached_blocks_and_moves_cached_blocks_in_use_with_their_hash():
    a = BlockAllocator(8, 16)
    blocks = a.allocate(8)
    for b in (1, 6, 7):
        a.cache(b, H[b])
    a.free([b for b in blocks if b not in (6, 7)])  # in use: 6 (cached), 7 (cached); 1 is evictable
    plan = a.plan_resize(2)
    assert plan.num_blocks == 2 and plan.moves == {6: 0, 7: 1}  # the never-cached hole first, then the evictable
    a.apply(plan)
    assert (a.num_blocks, a.num_used, a.num_free, a.num_cached) == (2, 2, 0, 2)
    assert a.lookup([H[6]]) == [0] and a.lookup([H[7]]) == [1] and a.lookup([H[1]]) == []
    a.free([0, 1])
    assert a.num_free == 2 and a.lookup([H[6]]) == [0]


def test_block_hash_names_the_whole_prefix():
    assert hash_block(ROOT_HASH, [1, 2]) == hash_block(ROOT_HASH, [1, 2])
    assert hash_block(ROOT_HASH, [1, 2]) != hash_block(hash_block(ROOT_HASH, [0, 0]), [1, 2])
    assert hash_block(ROOT_HASH, [1, 2]) != hash_block(ROOT_HASH, [2, 1])


def test_next_turn_reuses_the_conversation_and_answers_as_without_the_cache():
    """A chat turn resends the last prompt and answer: their full blocks are hits, and the answer is the
    one a cold engine gives."""
    turn1 = [(7 * j) % 50 + 2 for j in range(21)]
    warm = LLMEngine(FakeBackend(block_size=4), vllm_like())
    out1 = finish(warm, turn1, rid="t1")
    turn2 = turn1 + out1 + [9, 9, 9]  # 30 tokens; the first turn's 26 computed tokens fill 6 blocks
    out2 = finish(warm, turn2, rid="t2")
    assert out2 == finish(LLMEngine(FakeBackend(block_size=4), vllm_like(), enable_prefix_caching=False), turn2)
    assert (warm.prefix_cache.queries, warm.prefix_cache.hits) == (21 + 30, 0 + 6 * 4)
    check_accounting(warm)


def test_a_block_is_reused_only_under_its_own_prefix():
    """The same tokens after another prefix have other KV: [C, B] must not take the B block of [A, B]."""
    a, b, c = [2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13]
    engine = LLMEngine(FakeBackend(block_size=4), vllm_like())
    finish(engine, a + b + [20], rid="ab")
    finish(engine, c + b + [21], rid="cb")
    out = finish(engine, c + b + [22], rid="cb2")
    assert engine.prefix_cache.hits == 8
    assert out == finish(LLMEngine(FakeBackend(block_size=4), vllm_like(), enable_prefix_caching=False), c + b + [22])


def test_a_fully_cached_prompt_still_computes_its_last_token():
    engine = LLMEngine(FakeBackend(block_size=4), vllm_like())
    prompt = list(range(2, 14))  # 3 full blocks
    first = finish(engine, prompt, rid="a")
    seq = engine.add_request("b", prompt, params())
    batch = engine.scheduler.schedule()
    assert [(it.start, it.num_tokens, it.sample) for it in batch.items] == [(8, 4, True)]  # 2 blocks hit
    assert batch.prefix_queries == 12 and batch.prefix_hits == 8
    engine.scheduler.update(batch, engine.backend.execute(batch))
    while engine.has_unfinished():
        engine.step()
    assert seq.output_ids == first


def test_concurrent_requests_share_cached_blocks():
    engine = LLMEngine(FakeBackend(block_size=4), vllm_like())
    system = list(range(2, 18))  # 4 full blocks
    finish(engine, system + [30], rid="warm")
    seqs = [engine.add_request(str(i), system + [40 + i], params(12)) for i in range(3)]
    engine.step()
    tables = [s.block_table for s in seqs]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]
    assert engine.allocator.num_used == 4 + 3  # shared prefix once, one own block each
    check_accounting(engine)
    while engine.has_unfinished():
        engine.step()
    assert engine.allocator.num_used == 0 and engine.allocator.num_free == engine.allocator.num_blocks


def test_off_switch_caches_nothing():
    engine = LLMEngine(FakeBackend(block_size=4), vllm_like(), enable_prefix_caching=False)
    prompt = list(range(2, 30))
    finish(engine, prompt, rid="a")
    records = []
    engine.step_listeners.append(lambda rec, batch: records.append(rec))
    finish(engine, prompt, rid="b")
    assert engine.prefix_cache is None and engine.allocator.num_cached == 0
    assert records[0].shape.prefill_tokens == len(prompt)
    assert all(r.prefix_cache_queries == r.prefix_cache_hits == 0 for r in records)


def mixed_traffic(enable_prefix_caching: bool, seed: int) -> LLMEngine:
    """Requests sharing a few system prompts (and resending earlier answers), on a pool small enough to
    preempt, with aborts and pool resizes between steps; the accounting is checked after every step."""
    rng = random.Random(seed)
    engine = LLMEngine(FakeBackend(num_blocks=32, block_size=4), vllm_like(), enable_prefix_caching)
    systems = [[rng.randrange(2, 50) for _ in range(rng.choice((6, 9, 13)))] for _ in range(3)]
    engine.seqs = []
    for step in range(600):
        if step < 120 and rng.random() < 0.5:
            prompt = rng.choice(systems) + [rng.randrange(2, 50) for _ in range(rng.randrange(1, 8))]
            done = [s for s in engine.seqs if s.finish_reason == "length"]
            if done and rng.random() < 0.4:  # the next turn of an earlier conversation
                prev = rng.choice(done)
                prompt = [*prev.prompt_ids, *prev.output_ids, *prompt[-2:]]
            engine.seqs.append(engine.add_request(f"r{step}", prompt[:60], params(rng.randrange(1, 24))))
        if step % 17 == 5 and engine.scheduler.running:
            engine.abort(rng.choice(engine.scheduler.running).request_id)
        if step % 23 == 11:
            engine.resize_kv_pool(rng.choice((24, 32, 48)))
        engine.step()
        check_accounting(engine)
        if step >= 120 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    return engine


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_traffic_keeps_exact_accounting_and_outputs(seed):
    engine = mixed_traffic(True, seed)
    assert engine.prefix_cache.hits > 0 and engine.scheduler.num_preemptions > 0
    assert engine.allocator.num_used == 0
    done = [s for s in engine.seqs if s.finish_reason == "length"]
    assert len(done) > 10 and any(s.finish_reason == "abort" for s in engine.seqs)
    for s in done:  # each answer is the one a cold engine gives the request alone
        cold = LLMEngine(FakeBackend(block_size=4), vllm_like(), enable_prefix_caching=False)
        assert s.output_ids == finish(cold, s.prompt_ids, s.max_tokens)


def test_mixed_traffic_without_the_cache_keeps_exact_accounting():
    engine = mixed_traffic(False, 0)
    assert engine.allocator.num_cached == 0 and engine.scheduler.num_preemptions > 0
