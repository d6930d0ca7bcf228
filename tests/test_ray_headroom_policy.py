"""The headroom router's choice without Ray: who can take a prompt now, the least work ahead among them (power of
two as a draw), the ledger of what was routed since the last stats, the prefix homes, and the prompt sizes and
prefixes the ingress computes."""

from __future__ import annotations

import json
import random
from collections import Counter

from engine.model.standin_tokenizer import StandInTokenizer
from engine.serving.ray_serve.headroom_policy import (
    LEDGER_SLACK_S,
    UNKNOWN_STEP_TOKENS,
    Affinity,
    Headroom,
    Ledger,
    Prompt,
    choose_two,
    rank,
)
from engine.serving.ray_serve.prompt_size import MIN_PREFIX_TOKENS, PREFIX_CHARS, size_prompt


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
    firsts = Counter(rank(views, Prompt(8192), random.Random(seed))[0] for seed in range(200))
    assert set(firsts) == {"a", "b"} and min(firsts.values()) > 50
    order = rank(views, Prompt(8192), random.Random(0))
    assert sorted(order) == sorted(views) and order[-1] == "busy"  # the rest follow, least work ahead first


def test_rank_prefers_the_drawn_replica_with_less_work_ahead() -> None:
    views = {"light": Headroom.of(stats(queued=100)), "heavy": Headroom.of(stats(queued=2000))}
    assert all(rank(views, Prompt(50), random.Random(seed))[0] == "light" for seed in range(20))


def test_rank_falls_back_to_healthy_replicas_when_none_can_take_it_now() -> None:
    views = {"full": Headroom.of(stats(queued=9000)), "fuller": Headroom.of(stats(queued=20000)),
             "dead": Headroom.of(stats(healthy=False))}  # fmt: skip
    for seed in range(20):
        order = rank(views, Prompt(8192), random.Random(seed))
        assert order[0] == "full" and order[-1] == "dead"


def test_the_least_loaded_able_replica_goes_first_and_power_of_two_remains_as_a_draw() -> None:
    views = {f"r{i}": Headroom.of(stats(queued=10 * i)) for i in range(4)}
    assert all(rank(views, Prompt(100), random.Random(seed))[:2] == ["r0", "r1"] for seed in range(50))
    firsts = Counter(choose_two(views, Prompt(100), random.Random(seed), draw=2)[0] for seed in range(400))
    assert firsts["r3"] == 0  # the most loaded never wins a draw of two
    assert firsts["r0"] > firsts["r1"] > firsts["r2"] > 0


def test_equal_work_ahead_is_a_random_tie_not_the_first_replica() -> None:
    views = {f"r{i}": Headroom.of(stats(queued=100)) for i in range(4)}
    firsts = Counter(choose_two(views, Prompt(100), random.Random(seed))[0] for seed in range(200))
    assert set(firsts) == set(views) and min(firsts.values()) > 20


def test_a_burst_within_one_stats_period_spreads_through_the_ledger() -> None:
    """Stats published once; eight prompts routed one after another each see what the ones before them added."""
    published = {f"r{i}": stats(queued=0) for i in range(4)}
    clock, sent = Clock(), Counter()
    ledger = Ledger(clock)
    for seed in range(8):
        views = {k: Headroom.of(v, ledger.routed_since(k, clock.t)) for k, v in published.items()}
        first = choose_two(views, Prompt(500), random.Random(seed))[0]
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
    assert size_prompt(body).tokens == 2 * len(tok.encode(tok.apply_chat_template(messages)))
    parts = [{"role": "user", "content": [{"type": "text", "text": "abcdefgh"}]}]
    assert size_prompt(json.dumps({"messages": parts}).encode()).tokens == len(
        tok.encode(tok.apply_chat_template([{"role": "user", "content": "abcdefgh"}]))
    )
    assert size_prompt(b'{"prompt": "abcde"}').tokens == 2
    assert size_prompt(b'{"prompt": ["abcd", "abcdefgh"]}').tokens == 3
    assert size_prompt(b'{"prompt": [1, 2, 3]}').tokens == 3
    assert size_prompt(b'{"prompt": [[1, 2], [3]]}').tokens == 3
    for junk in (b"{bad", b"[1]", b'{"prompt": 5}', b"", b"\xff"):
        assert size_prompt(junk).tokens == 0


def test_the_prefix_key_is_the_system_turns_or_a_long_prompts_head() -> None:
    system = {"role": "system", "content": "s" * 4 * MIN_PREFIX_TOKENS}
    one, two = ({"messages": [system, {"role": "user", "content": q}]} for q in ("first", "second question"))
    a, b = size_prompt(json.dumps(one).encode()), size_prompt(json.dumps(two).encode())
    shared = StandInTokenizer().apply_chat_template([system], add_generation_prompt=False)
    assert a.prefix is not None and a.prefix == b.prefix and a.tokens != b.tokens
    assert a.prefix_tokens == len(shared) // 4 < a.tokens  # whole tokens of the system turn: a prefix of the chat
    other = {"messages": [{**system, "content": "t" * 4 * MIN_PREFIX_TOKENS}, {"role": "user", "content": "first"}]}
    assert size_prompt(json.dumps(other).encode()).prefix != a.prefix
    short = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x" * 8000}]}
    assert size_prompt(json.dumps(short).encode()).prefix is None  # too short to be worth routing for
    head = "h" * PREFIX_CHARS
    long_a, long_b = (size_prompt(json.dumps({"prompt": head + tail}).encode()) for tail in ("a", "b" * 50))
    assert long_a.prefix == long_b.prefix is not None and long_a.prefix_tokens == PREFIX_CHARS // 4
    assert size_prompt(json.dumps({"prompt": head}).encode()).prefix is None  # no longer than its head


def test_a_prompt_goes_home_while_its_cached_prefix_outweighs_the_queue_there() -> None:
    views = {"home": Headroom.of(stats(queued=900)), "idle": Headroom.of(stats(queued=500))}
    affinity = Affinity()
    affinity.routed("tenant", "home")
    prompt = affinity.prompt(700, "tenant", 512)
    assert prompt.to_prefill("home") == 188 and prompt.to_prefill("idle") == 700
    assert all(rank(views, prompt, random.Random(seed))[0] == "home" for seed in range(20))  # 900+188 < 500+700
    assert rank(views, affinity.prompt(700, "stranger", 512), random.Random(0))[0] == "idle"
    views["home"] = Headroom.of(stats(queued=1200))
    assert rank(views, prompt, random.Random(0))[0] == "idle"  # 1200+188 > 500+700: balance wins
    affinity.forget("home")
    assert affinity.prompt(700, "tenant", 512) == Prompt(700)


def test_affinity_remembers_the_last_home_and_a_bounded_number_of_prefixes(monkeypatch) -> None:
    from engine.serving.ray_serve import headroom_policy

    monkeypatch.setattr(headroom_policy, "AFFINITY_PREFIXES", 2)
    affinity = Affinity()
    affinity.routed("a", "r0")
    affinity.routed("a", "r1")
    affinity.routed(None, "r0")  # a prompt without a shared prefix
    assert affinity.prompt(100, "a", 50).home == "r1"
    affinity.routed("b", "r0")
    affinity.routed("c", "r0")  # the third prefix: the least recently routed ("a") is forgotten
    assert affinity.prompt(100, "a", 50) == Prompt(100) and affinity.prompt(100, "b", 50).home == "r0"
