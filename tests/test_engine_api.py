"""The engine's typed surface: every backend declares the whole contract (engine/core/backend.py), wrappers pass it
through method by method, finish listeners get a frozen record, the engine's counters come as a frozen
EngineStats, and a decode burst (the load generators' fast path) is the engine's own, run only where it is exact."""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine.backends.twin.backend import TwinBackend, as_twin
from engine.backends.twin.tensor_parallel import TwinGroup
from engine.baselines.seed import FixedPolicy
from engine.core.backend import Backend
from engine.core.faults import OOMInjector
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.core.stats import EngineStats, FinishedRequest
from engine.serving.async_engine import QueueFullError, refuse_when_full
from tests.fake_backend import FakeBackend

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)


def members(protocol: type) -> set[str]:
    """What the protocol declares: its attributes, properties and methods."""
    declared = set(protocol.__annotations__) | {n for n in vars(protocol) if not n.startswith("_")}
    return declared - {"__annotations__"}


@pytest.mark.parametrize(
    "make",
    [
        lambda: TwinBackend(num_blocks=8),
        lambda: TwinGroup(2, "rtx4090-llama3.1-8b", num_blocks=8),
        lambda: OOMInjector(TwinBackend(num_blocks=8), 0.0),
        FakeBackend,
    ],
    ids=["twin", "twin-tp2", "oom-injector", "fake"],
)
def test_every_backend_declares_the_whole_contract(make) -> None:  # noqa: ANN001
    backend = make()
    missing = sorted(name for name in members(Backend) if not hasattr(backend, name))
    assert not missing, f"{type(backend).__name__} lacks {missing}"
    assert backend.rank_samples() == [] or len(backend.rank_samples()) == 2
    assert set(backend.info().as_dict()) == {"dtype", "quantization", "attention", "kv_pool"}


def test_a_wrapper_passes_the_contract_through_but_no_decode_burst() -> None:
    twin = TwinBackend(num_blocks=8)
    wrapped = OOMInjector(twin, 0.0)
    assert (wrapped.num_blocks, wrapped.block_bytes, wrapped.can_swap) == (8, twin.block_bytes, True)
    assert wrapped.info() == twin.info() and wrapped.probe is twin.probe
    wrapped.advance_to(5.0)
    assert twin.now() == wrapped.now() == 5.0
    assert twin.decode_step([10, 20], math.inf) == [1011, 1021]  # the filler tokens after positions 10 and 20
    assert wrapped.decode_step([10, 20], math.inf) is None  # a burst would skip the injected OOMs
    assert TwinGroup(2, "rtx4090-llama3.1-8b", num_blocks=8).decode_step([10], math.inf) is None
    with pytest.raises(TypeError, match="runs on the twin"):
        as_twin(wrapped)


def test_finish_listeners_get_a_frozen_record_and_stats_a_frozen_snapshot() -> None:
    engine = LLMEngine(FakeBackend(), FixedPolicy())
    records: list[FinishedRequest] = []
    engine.finish_listeners.append(records.append)
    seq = engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    (record,) = records
    assert record is not seq and isinstance(record, FinishedRequest)
    assert (record.output_ids, record.finish_reason, record.prompt_len) == (tuple(seq.output_ids), "length", 3)
    assert len(record.token_times) == 4 and record.first_token_time == record.token_times[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.finish_reason = "stop"  # type: ignore[misc]
    stats = engine.stats()
    assert isinstance(stats, EngineStats) and stats.steps == engine.step_id == 4
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used, stats.healthy) == (0, 0, 0, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.steps = 0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        engine.step_id = 0  # type: ignore[misc]


def _decoding_twin(requests: int = 2) -> LLMEngine:
    """A static policy on the twin after a decode-only step: the next steps are identical decodes."""
    engine = LLMEngine(TwinBackend(num_blocks=64), FixedPolicy())
    for i in range(requests):
        engine.add_request(str(i), [1 + i] * 32, GREEDY)
    while any(not s.is_decode for s in engine.requests.values()):
        engine.step()
    engine.step()  # a decode-only step: the one a burst repeats
    return engine


def test_a_decode_burst_stops_one_step_short_of_the_first_finish_and_counts_its_steps() -> None:
    engine = _decoding_twin()
    before, left = engine.step_id, min(s.max_tokens - len(s.output_ids) for s in engine.requests.values())
    assert engine.decode_burst() == left - 1
    assert engine.step_id == before + left - 1 and engine.decode_burst() == 0  # the last step is step()'s
    assert all(len(s.token_times) == len(s.output_ids) for s in engine.requests.values())
    assert [o.finish_reason for o in engine.step()] == ["length", "length"]


def test_a_decode_burst_runs_only_where_nothing_can_change_the_schedule() -> None:
    engine = _decoding_twin()
    engine.add_request("late", [9] * 32, GREEDY)
    assert engine.decode_burst() == 0  # it must be packed first
    engine.step()
    engine.abort("late")
    assert engine.decode_burst() == 0  # an abort changes the schedule too
    engine.step()
    engine.step_listeners.append(lambda record, batch: None)
    assert engine.decode_burst() == 0  # a listener would miss the burst's steps
    engine.step_listeners.clear()
    assert engine.decode_burst(until=engine.now()) == 0  # the next step would start at the deadline
    assert engine.decode_burst() > 0
    asks = _decoding_twin(1)
    asks.add_request("logprobs", [7] * 32, SamplingParams(max_tokens=40, ignore_eos=True, logprobs=1))
    while any(not s.is_decode for s in asks.requests.values()):
        asks.step()
    asks.step()
    assert asks.decode_burst() == 0  # the burst keeps no logprobs


def test_the_fleet_and_the_server_share_the_queue_full_rule() -> None:
    refuse_when_full(255, 256)
    with pytest.raises(QueueFullError):
        refuse_when_full(256, 256)
