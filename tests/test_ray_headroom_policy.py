"""The headroom router's choice without Ray: who can take a prompt now, power of two among them, the ledger of
what was routed since the last stats, and the prompt sizes the ingress computes."""

from __future__ import annotations

import json
import random
from collections import Counter

from engine.serving.ray_serve.headroom_policy import (
    LEDGER_SLACK_S,
    UNKNOWN_STEP_TOKENS,
    Headroom,
    Ledger,
    choose_two,
    rank,
)
from engine.serving.ray_serve.prompt_size import prompt_tokens
from engine.serving.standin import StandInTokenizer


def stats(step: int = 4096, queued: int = 0, free_blocks: int = 100, waiting: int = 0, running: int = 0,
          healthy: bool = True) -> dict:  # fmt: skip
    return {"effective_prefill_tokens": step, "queued_prefill_tokens": queued, "kv_blocks_free": free_blocks,
            "block_size": 256, "num_waiting": waiting, "num_running": running, "healthy": healthy}  # fmt: skip


def test_a_replica_can_take_a_prompt_whose_first_step_fits_beside_its_queue() -> None:
    assert Headroom.of(stats(step=4096)).can_take(4096)
    assert Headroom.of(stats(step=4096)).can_take(8192)  # chunked: its first 4096 tokens fit the next step
    assert not Headroom.of(stats(step=4096, queued=1)).can_take(8192)
    assert Headroom.of(stats(step=4096, queued=4000)).can_take(96)
    assert not Headroom.of(stats(step=4096, queued=4000)).can_take(97)
    assert not Headroom.of(stats(step=4096, queued=4000), routed_tokens=96).can_take(1)


def test_free_kv_and_health_and_a_zero_step_bound_what_a_replica_can_take() -> None:
    assert Headroom.of(stats(free_blocks=32)).can_take(8192)
    assert not Headroom.of(stats(free_blocks=31)).can_take(8192)
    assert not Headroom.of(stats(free_blocks=32, queued=1)).can_take(8192)
    assert not Headroom.of(stats(healthy=False)).can_take(1)
    assert not Headroom.of(stats(step=0)).can_take(1)


def test_a_replica_without_stats_counts_only_what_was_routed_to_it() -> None:
    fresh = Headroom.of({}, routed_tokens=100)
    assert fresh.step_tokens == UNKNOWN_STEP_TOKENS and fresh.queued_tokens == 100 and fresh.can_take(1000)
    assert not Headroom.of({"healthy": False}).can_take(1)


def test_rank_picks_only_among_replicas_that_can_take_the_prompt() -> None:
    views = {"busy": Headroom.of(stats(queued=4096)), "a": Headroom.of(stats()), "b": Headroom.of(stats()),
             "c": Headroom.of(stats(queued=3000))}  # fmt: skip
    firsts = Counter(rank(views, 8192, random.Random(seed))[0] for seed in range(200))
    assert set(firsts) == {"a", "b"} and min(firsts.values()) > 50
    order = rank(views, 8192, random.Random(0))
    assert sorted(order) == sorted(views) and order[-1] == "busy"  # the rest follow, least work ahead first


def test_rank_prefers_the_drawn_replica_with_less_work_ahead() -> None:
    views = {"light": Headroom.of(stats(queued=100)), "heavy": Headroom.of(stats(queued=2000))}
    assert all(rank(views, 50, random.Random(seed))[0] == "light" for seed in range(20))


def test_rank_falls_back_to_healthy_replicas_when_none_can_take_it_now() -> None:
    views = {"full": Headroom.of(stats(queued=9000)), "fuller": Headroom.of(stats(queued=20000)),
             "dead": Headroom.of(stats(healthy=False))}  # fmt: skip
    for seed in range(20):
        order = rank(views, 8192, random.Random(seed))
        assert order[0] == "full" and order[-1] == "dead"


def test_the_least_loaded_able_replica_goes_first_and_power_of_two_remains_as_a_draw() -> None:
    views = {f"r{i}": Headroom.of(stats(queued=10 * i)) for i in range(4)}
    assert all(rank(views, 100, random.Random(seed))[:2] == ["r0", "r1"] for seed in range(50))
    firsts = Counter(choose_two(views, 100, random.Random(seed), draw=2)[0] for seed in range(400))
    assert firsts["r3"] == 0  # the most loaded never wins a draw of two
    assert firsts["r0"] > firsts["r1"] > firsts["r2"] > 0


def test_a_burst_within_one_stats_period_spreads_through_the_ledger() -> None:
    """Stats published once; eight prompts routed one after another each see what the ones before them added."""
    published = {f"r{i}": stats(queued=0) for i in range(4)}
    clock, sent = Clock(), Counter()
    ledger = Ledger(clock)
    for seed in range(8):
        views = {k: Headroom.of(v, ledger.routed_since(k, clock.t)) for k, v in published.items()}
        first = choose_two(views, 500, random.Random(seed))[0]
        ledger.add(first, 500)
        sent[first] += 1
    assert sorted(sent.values()) == [2, 2, 2, 2]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_ledger_keeps_routed_tokens_until_stats_taken_after_them() -> None:
    clock = Clock()
    ledger = Ledger(clock)
    ledger.add("a", 100)
    clock.t += 1
    ledger.add("a", 50)
    assert ledger.routed_since("a", None) == 150
    assert ledger.routed_since("a", 1000.0 + LEDGER_SLACK_S / 2) == 150  # maybe not seen yet
    assert ledger.routed_since("a", 1000.0 + 2 * LEDGER_SLACK_S) == 50
    assert ledger.routed_since("b", None) == 0
    clock.t += 60  # a replica that stopped publishing: entries age out
    assert ledger.routed_since("a", None) == 0
    ledger.add("a", 7)
    ledger.forget("a")
    assert ledger.routed_since("a", None) == 0


def test_prompt_size_follows_the_stand_in_tokenizer_for_chat_and_prompts() -> None:
    tok = StandInTokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x" * 8191}]
    body = json.dumps({"messages": messages, "n": 2}).encode()
    assert prompt_tokens(body) == 2 * len(tok.encode(tok.apply_chat_template(messages)))
    parts = [{"role": "user", "content": [{"type": "text", "text": "abcdefgh"}]}]
    assert prompt_tokens(json.dumps({"messages": parts}).encode()) == len(
        tok.encode(tok.apply_chat_template([{"role": "user", "content": "abcdefgh"}]))
    )
    assert prompt_tokens(b'{"prompt": "abcde"}') == 2
    assert prompt_tokens(b'{"prompt": ["abcd", "abcdefgh"]}') == 3
    assert prompt_tokens(b'{"prompt": [1, 2, 3]}') == 3
    assert prompt_tokens(b'{"prompt": [[1, 2], [3]]}') == 3
    for junk in (b"{bad", b"[1]", b'{"prompt": 5}', b"", b"\xff"):
        assert prompt_tokens(junk) == 0
