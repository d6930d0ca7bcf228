"""Scheduler and engine loop on a model-free backend: limits enforced, KV accounting exact, preemption and
chunking invisible in the output."""

from __future__ import annotations

import pytest

from controller.limits import Limits
from controller.policy import StaticPolicy
from controller.step_budget import NO_CUTS, MemoryCuts, StepBudget
from engine.baselines.seed import FixedPolicy, SeedStaticPolicy
from engine.baselines.vllm import VllmPolicy
from engine.core.kv.blocks import BlockAllocator
from engine.core.llm_engine import LLMEngine, RequestError
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from tests.fake_backend import FakeBackend

PROMPTS = [[(i * 13 + j) % 50 + 2 for j in range(n)] for i, n in enumerate([3, 17, 40, 9, 64, 5, 33, 21])]


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    seqs = [
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs]


def vllm_like(**caps) -> FixedPolicy:
    return FixedPolicy(kv_reserve_ratio=0.0, allow_mixed=True, prefill_first=False, max_num_seqs=256, **caps)


def production(**limits) -> StaticPolicy:
    """The production scheduler's rules under static limits (and the production engine's OOM recovery)."""
    return StaticPolicy(Limits(max_num_seqs=256, **limits))


def alone(prompts: list[list[int]]) -> list[list[int]]:
    return [run(LLMEngine(FakeBackend(), vllm_like()), [p])[0] for p in prompts]


@pytest.mark.parametrize(
    "policy,num_blocks",
    [
        (vllm_like(), 64),
        (vllm_like(max_prefill_tokens=8), 64),
        (vllm_like(max_batched_tokens=10), 64),
        (FixedPolicy(), 64),
        (SeedStaticPolicy(), 64),
        (vllm_like(), 24),  # small pool: preemption by recompute
    ],
)
def test_batched_equals_alone_and_frees_every_block(policy, num_blocks):
    backend = FakeBackend(num_blocks=num_blocks)
    engine = LLMEngine(backend, policy)
    assert run(engine, PROMPTS) == alone(PROMPTS)
    assert engine.allocator.num_used == 0 and engine.allocator.num_free == num_blocks
    assert not engine.requests


def test_small_pool_preempts():
    engine = LLMEngine(FakeBackend(num_blocks=24), vllm_like())
    run(engine, PROMPTS)
    assert engine.scheduler.num_preemptions > 0


def test_limits_are_enforced_every_step():
    backend = FakeBackend()
    engine = LLMEngine(backend, vllm_like(max_prefill_tokens=8, max_decode_seqs=3, max_prefill_seqs=2))
    run(engine, PROMPTS)
    for b in backend.steps:
        assert b.shape.prefill_tokens <= 8 and b.shape.decode_seqs <= 3 and b.shape.prefill_seqs <= 2
    assert any(b.chunked for b in backend.steps)


def test_seed_static_never_mixes_and_defers_long_prompts():
    backend = FakeBackend(num_blocks=400, block_size=16, max_model_len=8192)
    engine = LLMEngine(backend, SeedStaticPolicy())
    run(engine, [[5] * 4096, [6] * 4096, [7] * 10], max_tokens=4)
    for b in backend.steps:
        assert not (b.shape.prefill_seqs and b.shape.decode_seqs)
        long = [it for it in b.items if len(it.prompt_ids) >= 4096]
        assert len(long) <= 1
    # The second long prompt waits until the first one's decodes are done.
    first_long_decode = next(
        i for i, b in enumerate(backend.steps) if any(not it.is_prefill and it.request_id == "0" for it in b.items)
    )
    second_prefill = next(
        i for i, b in enumerate(backend.steps) if any(it.is_prefill and it.request_id == "1" for it in b.items)
    )
    assert second_prefill > first_long_decode


def test_whole_request_reservation_caps_admission():
    # 10 blocks of 4 tokens; each request needs ceil((4 + 12) / 4) = 4 blocks: only 2 run at once.
    backend = FakeBackend(num_blocks=10)
    engine = LLMEngine(backend, FixedPolicy())
    run(engine, [[3, 4, 5, 6]] * 5)
    assert max(b.shape.decode_seqs + b.shape.prefill_seqs for b in backend.steps) == 2
    assert engine.scheduler.num_preemptions == 0


def test_stop_conditions():
    engine = LLMEngine(FakeBackend(), vllm_like())
    out = run(engine, [PROMPTS[0]], max_tokens=5)[0]
    seq = engine.add_request("eos", PROMPTS[0], SamplingParams(max_tokens=20, stop_token_ids=[out[2]]))
    seq_min = engine.add_request(
        "min", PROMPTS[0], SamplingParams(max_tokens=20, stop_token_ids=[out[2]], min_tokens=4)
    )
    while engine.has_unfinished():
        engine.step()
    assert seq.output_ids == out[:3] and seq.finish_reason == "stop"
    assert len(seq_min.output_ids) >= 4


@pytest.mark.parametrize(
    "prompt,params,param",
    [
        ([], SamplingParams(), "prompt"),
        ([1] * 512, SamplingParams(), "prompt"),
        ([1] * 500, SamplingParams(max_tokens=20), "max_tokens"),
        ([1] * 5, SamplingParams(max_tokens=0), "max_tokens"),
        ([1] * 5, SamplingParams(temperature=-1), "temperature"),
    ],
)
def test_bad_requests_are_rejected_at_arrival(prompt, params, param):
    engine = LLMEngine(FakeBackend(), vllm_like())
    with pytest.raises(RequestError) as e:
        engine.add_request("x", prompt, params)
    assert e.value.param == param
    assert not engine.has_unfinished()


def test_max_tokens_none_runs_to_context():
    engine = LLMEngine(FakeBackend(max_model_len=64), vllm_like())
    seq = engine.add_request("x", [1] * 60, SamplingParams(max_tokens=None, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(seq.output_ids) == 4 and seq.finish_reason == "length"


def test_abort_frees_blocks():
    engine = LLMEngine(FakeBackend(), vllm_like())
    engine.add_request("a", PROMPTS[4], SamplingParams(max_tokens=50))
    engine.step()
    assert engine.allocator.num_used > 0
    engine.abort("a")
    assert engine.allocator.num_used == 0 and not engine.has_unfinished()


def test_injected_ooms_are_recovered_without_losing_or_duplicating_work():
    from engine.core.faults import OOMInjector

    policy = production()
    backend = OOMInjector(FakeBackend(), rate=0.2, seed=1)
    engine = LLMEngine(backend, policy)
    finished = []
    engine.finish_listeners.append(lambda s: finished.append(s.request_id))
    assert run(engine, PROMPTS) == alone(PROMPTS)
    assert backend.injected > 0 and engine.ooms_recovered == backend.injected and engine.healthy
    assert sorted(finished) == sorted(str(i) for i in range(len(PROMPTS)))
    assert engine.allocator.num_used == 0


def test_unrecovered_oom_kills_the_engine_like_the_seed():
    from engine.core.faults import OOMInjector
    from engine.core.llm_engine import EngineDeadError

    engine = LLMEngine(OOMInjector(FakeBackend(), rate=0.5, seed=3), FixedPolicy())
    seqs = [engine.add_request(str(i), p, SamplingParams(max_tokens=30)) for i, p in enumerate(PROMPTS)]
    while engine.has_unfinished():
        engine.step()
    assert not engine.healthy and all(s.finish_reason == "error" for s in seqs)
    assert engine.allocator.num_used == 0
    with pytest.raises(EngineDeadError):
        engine.add_request("late", PROMPTS[0], SamplingParams())


def test_finished_requests_teach_the_adaptive_kv_reservation():
    from controller.adaptive import AdaptivePolicy

    policy = AdaptivePolicy()
    engine = LLMEngine(FakeBackend(), policy)
    assert run(engine, PROMPTS, max_tokens=6) == [out[:6] for out in alone(PROMPTS)]
    kv = policy.state()["kv_reservation"]
    assert policy.kv.finished == len(PROMPTS) and kv["used_share"] == 1.0  # every request ran to max_tokens


def test_logprobs_are_appended_once_per_sampled_token_through_ooms():
    """On the twin (no logits: logprob 0 and the token as its only top entry) with injected OOMs: a failed
    step's tokens are never kept, so neither are their logprobs."""
    from engine.backends.twin.backend import TwinBackend
    from engine.core.faults import OOMInjector

    backend = OOMInjector(TwinBackend(num_blocks=64), rate=0.3, seed=2)
    engine = LLMEngine(backend, production())
    seqs = [engine.add_request(str(i), p, SamplingParams(max_tokens=9, logprobs=2)) for i, p in enumerate(PROMPTS)]
    seqs.append(engine.add_request("off", PROMPTS[0], SamplingParams(max_tokens=9)))
    while engine.has_unfinished():
        engine.step()
    assert backend.injected > 0
    for seq in seqs[:-1]:
        assert [(lp.logprob, lp.top) for lp in seq.output_logprobs] == [(0.0, [(t, 0.0)]) for t in seq.output_ids]
    assert seqs[-1].output_logprobs == []


def test_blocks_owed_counts_a_chunked_prefill_and_the_waiting_prompts():
    """Free blocks a chunked prefill is about to fill, or a waiting prompt needs, are not spare (the KV pool
    controller gives back only spare ones)."""
    policy = FixedPolicy(
        kv_reserve_ratio=0.0, allow_mixed=True, prefill_first=False, max_num_seqs=1, max_prefill_tokens=8
    )
    engine = LLMEngine(FakeBackend(num_blocks=64, block_size=4), policy)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("long", list(range(2, 22)), params)  # 20 tokens: 5 blocks, 8 tokens a step
    engine.add_request("queued", list(range(2, 12)), params)  # 10 tokens: 3 blocks, waits (max_num_seqs 1)
    engine.step()
    sched = engine.scheduler
    assert [len(s.block_table) for s in sched.running] == [2]
    assert sched.blocks_owed() == (5 - 2) + 3
    engine.step()
    assert sched.blocks_owed() == (5 - 4) + 3


@pytest.mark.parametrize("num_blocks", [20, 24])
def test_preemption_by_swap_is_invisible_in_the_output_and_never_recomputes(num_blocks):
    """A swapped-out sequence comes back with its KV copied in, not recomputed: outputs equal the lone runs
    (the fake backend scribbles over swapped-out slots, so a wrong copy would show), no prefill chunk ever
    covers a token that already had KV, and every block and host copy is given back."""
    backend = FakeBackend(num_blocks=num_blocks, can_swap=True)
    engine = LLMEngine(backend, vllm_like(preempt_by_swap=True))
    assert run(engine, PROMPTS) == alone(PROMPTS)
    assert engine.scheduler.num_preemptions > 0 and backend.swapped_blocks > 0
    recomputed = [
        it for b in backend.steps for it in b.items if it.is_prefill and it.start + it.num_tokens > len(it.prompt_ids)
    ]
    assert recomputed == []
    assert engine.allocator.num_used == 0 and backend.host == {}


def test_a_backend_that_cannot_swap_preempts_by_recompute():
    backend = FakeBackend(num_blocks=24)
    engine = LLMEngine(backend, vllm_like(preempt_by_swap=True))
    assert run(engine, PROMPTS) == alone(PROMPTS)
    assert engine.scheduler.num_preemptions > 0 and backend.swapped_blocks == 0


@pytest.mark.parametrize("policy,victim", [(VllmPolicy(), "newest"), (production(), "nearly-done")])
def test_the_preemption_victim_follows_the_policy(policy, victim):
    """vLLM v1 preempts the newest running request (`running.pop()`); our default evicts the one closest to
    its max_tokens."""
    engine = LLMEngine(FakeBackend(num_blocks=6, block_size=4), policy)
    for i, (rid, max_tokens) in enumerate((("oldest", 8), ("nearly-done", 2), ("newest", 8))):
        prompt = [10 * i + j for j in range(2, 10)]  # 8 tokens: 2 blocks each, so three fill the pool
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    steps = []
    engine.step_listeners.append(lambda record, batch: steps.append(batch))
    engine.step()  # three prefills
    engine.step()  # "oldest" needs a third block: a victim goes
    assert steps[1].preempted == [victim]


def test_production_scheduler_and_limits_carry_no_baseline_rules():
    """The seed's and vLLM's rules live in their baseline's scheduler, not in the production engine."""
    assert type(LLMEngine(FakeBackend(), production()).scheduler) is Scheduler
    assert type(LLMEngine(FakeBackend(), SeedStaticPolicy()).scheduler) is not Scheduler
    assert type(LLMEngine(FakeBackend(), VllmPolicy()).scheduler) is not Scheduler
    knobs = {"prefill_first", "allow_mixed", "long_prompt_threshold", "max_long_per_batch"}
    assert knobs.isdisjoint(Limits().as_dict()) and "preempt_newest" not in Limits().as_dict()


def test_a_production_engine_recovers_from_an_oom_where_a_baseline_stops():
    from engine.core.faults import OOMInjector

    for policy, healthy in ((production(), True), (vllm_like(), False)):
        engine = LLMEngine(OOMInjector(FakeBackend(), rate=0.5, seed=3), policy)
        run(engine, PROMPTS[:3])
        assert engine.ooms > 0 and engine.healthy is healthy


class CuttingPolicy(StaticPolicy):
    """A budget whose memory admits chunks of at most `cap` tokens and `decodes` decodes a step."""

    def __init__(self, cap: int, decodes: int, min_chunk: int = 1) -> None:
        super().__init__(Limits(max_num_seqs=256))
        self.calls = 0
        self.seen: list[MemoryCuts] = []

        def fit_chunk(shape, context, chunk):
            self.calls += 1
            return min(chunk, max(0, cap - shape.prefill_tokens))

        def fit_decodes(shape, contexts):
            self.calls += 1
            return min(len(contexts), decodes)

        self._budget = StepBudget(self._limits, fit_chunk, fit_decodes, min_chunk)

    def observe(self, record, cuts=NO_CUTS):
        self.seen.append(cuts)


def test_what_memory_cut_comes_through_the_scheduler_output_to_observe():
    backend = FakeBackend()
    policy = CuttingPolicy(cap=6, decodes=2)
    engine = LLMEngine(backend, policy)
    assert run(engine, PROMPTS) == alone(PROMPTS)
    cuts = [b.cuts for b in backend.steps]
    assert cuts == policy.seen  # observe() read each step's output, nothing else
    assert all(b.shape.prefill_tokens <= 6 and b.shape.decode_seqs <= 2 for b in backend.steps)
    assert any(c.chunks for c in cuts) and any(c.deferred_prefills for c in cuts)
    assert any(c.deferred_decodes for c in cuts)
    assert all(c.cut == bool(c.chunks or c.deferred) for c in cuts)


def test_liveness_an_empty_step_always_makes_progress():
    """Memory admitting nothing would stall the engine: an empty step still takes min_chunk tokens of a
    prompt (counted as a chunk memory cut) or one decode (not counted)."""
    backend = FakeBackend()
    engine = LLMEngine(backend, CuttingPolicy(cap=0, decodes=0, min_chunk=3))
    assert run(engine, PROMPTS[:2], max_tokens=3) == [out[:3] for out in alone(PROMPTS[:2])]
    for b in backend.steps:
        assert b.items and b.shape.prefill_tokens <= 3 and b.shape.decode_seqs <= 1
        assert b.cuts.chunks == b.items[0].is_prefill  # the liveness chunk; a decode's is not counted


def test_finished_requests_reach_the_backend_once():
    backend = FakeBackend()
    engine = LLMEngine(backend, production())
    run(engine, PROMPTS[:3], max_tokens=4)
    engine.add_request("late", PROMPTS[0], SamplingParams(max_tokens=2))
    engine.step()
    assert sorted(backend.dropped) == ["0", "1", "2"]


def test_allocate_slots_takes_what_a_sequence_needs_or_changes_nothing():
    alloc = BlockAllocator(4, 4)
    seq = Sequence("a", list(range(10)), SamplingParams(), 5)
    assert alloc.allocate_slots(seq, 9) == [0, 1, 2] and seq.block_table == [0, 1, 2]
    seq.num_computed = 9
    assert alloc.allocate_slots(seq, 3) == [] and seq.block_table == [0, 1, 2]  # 12 tokens: 3 blocks
    assert alloc.allocate_slots(seq, 8) is None and seq.block_table == [0, 1, 2] and alloc.num_free == 1
    assert alloc.allocate_slots(seq, 7) == [3] and alloc.num_free == 0
