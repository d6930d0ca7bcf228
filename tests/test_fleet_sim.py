"""The fleet simulator: deterministic, every request accounted for, no router sees the future, faults cost what
they should, and the routers follow their rules."""

from __future__ import annotations

import dataclasses
import gc
import json
import random
import subprocess
import sys

import pytest

from bench.fleet.command import PER_SEED, engine_config, summarize
from bench.fleet.load import PROMPT_VOCAB, FleetRequest, Scenario, generate
from bench.fleet.routers import ROUTERS, HeadroomNoPrefix, HeadroomRouter, PowerOfTwo
from bench.fleet.sim import STATS_PERIOD_S, Faults, FleetSim
from engine.serving.ray_serve.headroom_policy import Headroom, Prompt
from engine.serving.ray_serve.resend import MAX_RESENDS

SMALL = Scenario(duration_s=4.0, rate_per_replica=3.0)


def run(
    router: str,
    replicas: int = 3,
    seed: int = 0,
    faults: Faults | None = None,
    scenario: Scenario = SMALL,
    max_resends: int = MAX_RESENDS,
):
    sim = FleetSim(engine_config(), replicas, router, scenario, faults, seed, max_resends)
    return sim.run(generate(scenario, replicas, seed))


def test_the_load_keeps_its_mean_rate_through_the_burst_and_shifts_its_mix() -> None:
    s = Scenario(duration_s=200.0, rate_per_replica=2.0, long_share=(0.0, 0.5))
    reqs = generate(s, replicas=5, seed=3)
    assert len(reqs) == pytest.approx(2.0 * 5 * 200, rel=0.05)
    start, length, mult = s.burst
    in_burst = sum(start * 200 <= r.arrival < start * 200 + length for r in reqs)
    assert in_burst / length == pytest.approx(mult * s.rate_at(0.0) * 5, rel=0.25)
    assert not any(r.kind == "long" for r in reqs if r.arrival < 100)
    assert sum(r.kind == "long" for r in reqs if r.arrival >= 100) / sum(r.arrival >= 100 for r in reqs) > 0.4
    assert generate(s, 5, 3) == reqs and generate(s, 5, 4) != reqs


def test_chats_of_a_tenant_share_their_system_prompt_and_nothing_else() -> None:
    a, b = FleetRequest(1, 0.0, "chat", 600, 8, 7), FleetRequest(2, 0.0, "chat", 600, 8, 7)
    ids_a, ids_b = a.prompt_ids(512), b.prompt_ids(512)
    assert len(ids_a) == 600 and ids_a[:512] == ids_b[:512] and ids_a[512:] != ids_b[512:]
    long = FleetRequest(3, 0.0, "long", 8192, 16, -1).prompt_ids(512)
    assert len(long) == 8192 and long[:512] != ids_a[:512]


def test_filler_ids_are_the_modular_run_and_wrap_below_the_vocabulary() -> None:
    ids = FleetRequest(12, 0.0, "long", 250_000, 16, -1).prompt_ids(512)  # past PROMPT_VOCAB: wraps twice
    assert ids == [1 + (7_919 * 13 + j) % PROMPT_VOCAB for j in range(250_000)]
    assert min(ids) == 1 and max(ids) == PROMPT_VOCAB


@pytest.mark.parametrize("router", list(ROUTERS))
def test_every_router_is_deterministic_and_accounts_for_every_request(router: str) -> None:
    first, again = run(router, faults=Faults()), run(router, faults=Faults())
    assert first == again
    sent = len(generate(SMALL, 3, 0))
    assert len(first.finished) + sum(first.failed.values()) == sent
    assert "replica_died" not in first.failed and first.resends.resent + first.resends.resumed > 0
    lossy = run(router, faults=Faults(), max_resends=0)  # the ingress before re-sends
    assert len(lossy.finished) + sum(lossy.failed.values()) == sent
    assert lossy.failed["replica_died"] > 0 and len(lossy.finished) > 0.5 * sent
    assert all(f.ttft > 0 for f in first.finished)


def test_a_run_collects_cycles_rarely_and_restores_the_collector_after(monkeypatch) -> None:
    seen = []

    class Probe(PowerOfTwo):
        def choose(self, req: FleetRequest) -> int | None:
            seen.append(gc.get_threshold())
            return super().choose(req)

    monkeypatch.setitem(ROUTERS, "probe", Probe)
    before = gc.get_threshold()
    run("probe")
    assert seen and all(t[0] == 100_000 for t in seen) and gc.get_threshold() == before


def test_a_replica_that_dies_loses_what_it_held_and_comes_back() -> None:
    healthy = run("round_robin")
    assert sum(healthy.failed.values()) == 0
    faults = Faults(kill_at=0.5, kill_share=0.0, restart_after_s=1.0, squeeze_share=0.0)
    hit = run("round_robin", faults=faults, max_resends=0)  # one replica dies at 2 s and is back at 3 s
    assert 0 < hit.failed["replica_died"] < len(generate(SMALL, 3, 0)) / 3
    assert max(f.done_at for f in hit.finished) > 3.0


def test_what_a_dying_replica_held_is_resent_or_resumed_and_finishes_whole() -> None:
    """The ingress's rule: a request its client had nothing of starts over, a stream goes on after the tokens its
    client had, and each finishes with all its tokens; its TTFT is from its arrival to the first token its client
    got, on whichever replica."""
    faults = Faults(kill_at=0.5, kill_share=0.0, restart_after_s=1.0, squeeze_share=0.0)
    lossy = run("round_robin", faults=faults, max_resends=0)
    out = run("round_robin", faults=faults)
    reqs = generate(SMALL, 3, 0)
    assert sum(out.failed.values()) == 0 and len(out.finished) == len(reqs)
    resends = out.resends
    assert resends.resent + resends.resumed == lossy.failed["replica_died"] and resends.resumed > 0
    resent = [f for f in out.finished if f.resent]
    assert len(resent) == resends.resent + resends.resumed
    assert sorted(f.output_tokens for f in out.finished) == sorted(r.output_tokens for r in reqs)
    assert all(0 < f.ttft < f.done_at for f in resent)


def test_a_router_sees_a_finish_only_when_it_happens() -> None:
    """Steps are computed at their start, but a request's finish reaches the router's counts at its step's
    end: whenever the router chooses, every finish it has seen is in the past, and on one replica its count is
    what was sent less what has finished."""
    scenario = dataclasses.replace(SMALL, rate_per_replica=6.0)
    sim = FleetSim(engine_config(), 1, "default", scenario, None, 0)
    seen: list[tuple[float, float, int, int]] = []
    choose = sim.router.choose

    def watch(req: FleetRequest) -> int | None:
        last = max((f.done_at for f in sim.out.finished), default=0.0)
        seen.append((sim.now(), last, sim.ongoing[0], len(sim.out.finished)))
        return choose(req)

    sim.router.choose = watch  # type: ignore[method-assign]
    sim.run(generate(scenario, 1, 0))
    assert all(last <= now for now, last, _, _ in seen)
    assert all(ongoing == sent - done for sent, (_, _, ongoing, done) in enumerate(seen))
    assert max(ongoing for _, _, ongoing, _ in seen) > 1


class _Fleet:
    def __init__(self, ongoing: list[int], stats: list[dict]) -> None:
        self.ongoing, self.alive, self.max_ongoing, self._stats = ongoing, [True] * len(ongoing), 4, stats
        self.system_tokens = 512

    def stats(self, replica: int) -> dict:
        return self._stats[replica]

    def now(self) -> float:
        return 0.0


def test_power_of_two_takes_the_shorter_queue_of_two_and_skips_a_full_one() -> None:
    fleet = _Fleet([3, 1], [{}, {}])
    router = PowerOfTwo(fleet, random.Random(0))
    req = FleetRequest(0, 0.0, "chat", 100, 8, 0)
    assert {router.choose(req) for _ in range(20)} == {1}
    fleet.ongoing[:] = [4, 4]
    assert router.choose(req) is None  # both at max_ongoing: the request waits at the router


def test_the_headroom_router_sends_a_long_prompt_only_where_it_fits_and_counts_what_it_sent() -> None:
    def stats(queued: int) -> dict:
        return {"effective_prefill_tokens": 8192, "queued_prefill_tokens": queued, "kv_blocks_free": 80,
                "block_size": 256, "num_waiting": 0, "num_running": 0, "published_at": 0.0}  # fmt: skip

    fleet = _Fleet([0, 0, 0], [stats(3800), stats(0), stats(4096)])
    router = HeadroomRouter(fleet, random.Random(0))
    long = FleetRequest(0, 0.0, "long", 8192, 16, -1)
    assert {router.choose(long) for _ in range(20)} == {1}
    router.routed(1, long)
    assert router.views[1] == Headroom.of(stats(0), routed_tokens=8192)
    assert not router.views[1].can_take(8192)
    chat = FleetRequest(1, 0.0, "chat", 700, 16, tenant=3)
    router.routed(0, chat)  # the tenant's first chat: its system prompt is now cached at replica 0
    assert router.views[0] == Headroom.of(stats(3800), routed_tokens=700)
    again = FleetRequest(2, 0.0, "chat", 700, 16, tenant=3)
    assert router.choose(again) == 0  # 4500 + 188 (512 cached) queued there beats 4096 + 700 at replica 2
    blind = HeadroomNoPrefix(fleet, random.Random(0))
    blind.routed(1, long)
    blind.routed(0, chat)
    assert blind.choose(again) == 2  # without the prefix home: 4500 + 700 against 4096 + 700
    router.routed(0, again)
    assert router.views[0] == Headroom.of(stats(3800), routed_tokens=700 + 188)  # only the uncached part
    router.replaced(0)
    assert router._prompt(again) == Prompt(700)  # the home is lost with the replica


def test_stats_are_published_each_period_and_at_a_step_boundary() -> None:
    sim = FleetSim(engine_config(), 2, "headroom", SMALL, None, 0)
    published: list[tuple[int, float, float]] = []
    on_publish = sim.router.published

    def watch(i: int) -> None:
        published.append((i, sim.now(), sim.reps[i].clock()))
        on_publish(i)

    sim.router.published = watch  # type: ignore[method-assign]
    sim.run(generate(SMALL, 2, 0))
    assert all(clock <= t for _, t, clock in published)  # never mid-step
    times = [t for i, t, _ in published if i == 0]
    assert len(times) >= SMALL.duration_s / STATS_PERIOD_S - 1
    assert all(b - a >= STATS_PERIOD_S - 1e-9 for a, b in zip(times, times[1:], strict=False))


def test_summary_and_command_write_what_the_issue_asks(tmp_path) -> None:
    assert summarize(run("headroom"))["failed"] == 0
    out = tmp_path / "f.json"
    cmd = [sys.executable, "-m", "headroom.cli", "bench", "fleet", "--replicas", "2", "--seeds", "2", "--duration", "3",
           "--routers", "default,headroom", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    doc = json.loads(out.read_text())
    assert set(doc["routers"]) == {"default", "headroom"} and doc["replicas"] == 2
    for r in doc["routers"].values():
        assert len(r["ttft_p50_ms"]) == len(r["ttft_p99_ms"]) == 2
        assert isinstance(r["ooms"], int) and isinstance(r["failed"], int)
    bad = subprocess.run([*cmd[:-2], "--routers", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown router" in bad.stderr


def test_the_report_judges_near_capacity_by_the_median_and_the_worst_seed() -> None:
    from bench.fleet.report import summary, verdict

    def router(p50: list[float], p99: list[float]) -> dict:
        return {"seeds": [0, 1, 2], "ttft_p50_ms": p50, "ttft_p99_ms": p99}

    good = {"default": router([100, 120, 90], [1300, 2000, 900]), "headroom": router([90, 120, 80], [1000, 1900, 600])}
    assert verdict(good)[0]  # medians 1300 / 1000 = 1.3x, worst 2000 / 1900
    worse_tail = {**good, "headroom": router([90, 120, 80], [1000, 2100, 600])}
    assert not verdict(worse_tail)[0]
    slower_median = {**good, "headroom": router([130, 120, 80], [1000, 1900, 600])}
    assert not verdict(slower_median)[0]
    rows = summary([{"replicas": 8, "load": "near", "seeds": [0, 1, 2], "routers": good},
                    {"replicas": 8, "load": "above", "seeds": [0, 1, 2], "routers": worse_tail}])  # fmt: skip
    assert rows[2].endswith("| met |") and rows[3].endswith("| - |")
    other_seeds = {**good, "headroom": {**good["headroom"], "seeds": [0, 1, 3]}}
    assert verdict(other_seeds) == (False, "not judged: default ran seeds 0-2, headroom 0-1, 3")


def test_the_report_merges_runs_of_one_size_and_load_and_keeps_held_out_seeds_apart() -> None:
    from bench.fleet.report import merge, verdict

    def doc(seeds: list[int], routers: tuple[str, ...], load: str = "near") -> dict:
        runs = {k: [float(s) for s in seeds] for k in (*PER_SEED, "wall_s")}
        return {"replicas": 8, "load": load, "seeds": seeds, "command": f"run {seeds} {routers}", "wall_s": 1.0,
                "capacity_req_per_s_per_replica": 4.0, "scenario": {}, "faults": None,
                "routers": {r: {**runs, "ooms": 1, "failed": 2, "preemptions": 3} for r in routers}}  # fmt: skip

    docs = [doc([2], ("default",)), doc([0, 1], ("default", "a")), doc([0, 1, 2], ("b",)), doc([100], ("default",)),
            doc([0], ("default",), load="above")]  # fmt: skip
    docs[2]["renamed"] = "c -> b"
    near, held_out, above = merge(docs)
    assert near["seeds"] == [0, 1, 2] and near["commands"][:2] == [f"`{d['command']}`" for d in docs[:2]]
    assert near["commands"][2] == f"`{docs[2]['command']}` (a router renamed since: c -> b, the same rule)"
    assert list(near["routers"]) == ["default", "a", "b"] and near["wall_s"] == 3.0
    assert near["routers"]["default"]["seeds"] == [0, 1, 2] and near["routers"]["a"]["seeds"] == [0, 1]  # sorted
    judged = verdict({"default": near["routers"]["default"], "headroom": near["routers"]["b"]})[1]
    assert judged.startswith("TTFT p99"), judged  # the same seeds, though from runs in another order
    assert near["routers"]["default"]["ttft_p99_ms"] == [0.0, 1.0, 2.0] and near["routers"]["default"]["ooms"] == 2
    assert held_out["seeds"] == [100] and above["load"] == "above"
    with pytest.raises(ValueError, match="twice"):
        merge([doc([0, 1], ("default",)), doc([1], ("default",))])
    with pytest.raises(ValueError, match="not the load"):
        merge([doc([0], ("default",)), {**doc([1], ("default",)), "capacity_req_per_s_per_replica": 5.0}])
