"""The reliability benchmark's soak (many mixed requests, injected OOMs, clients hanging up, the controller
polled and patched all through) and overload (more clients than the queue holds) scenarios."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import http
from bench.harness.machine import load_average
from bench.harness.server import ServerProcess, headroom
from bench.reliability_answers import (
    REQUEST_TIMEOUT_S,
    Check,
    Outcome,
    RequestSpec,
    ScenarioResult,
    count_problems,
    idle_check,
    openai_error_problem,
    send,
    wait_idle,
    with_problems,
)

SOAK_OOM_RATE = 0.01
SOAK_DISCONNECT_SHARE = 0.05
RSS_GROWTH_LIMIT = 0.10
POLL_INTERVAL_S = 0.2
INVALID_PATCH_EVERY = 4  # poll rounds between invalid PATCHes
OVERLOAD_FACTOR = 4
OVERLOAD_PROMPT_TOKENS = 1024
OVERLOAD_MAX_TOKENS = 32
# Gains the soak's valid PATCHes move away from their value and back (all inside their bounds).
ALTERNATE_GAINS = {"margin_quantile": 0.9, "recovery_step": 0.01, "backoff_cooldown": 8}
# Each must get a 400 and leave the config as it was.
INVALID_PATCHES: tuple[Any, ...] = (
    {"no_such_gain": 1.0},
    {"backoff": 5.0},
    {"margin_quantile": "high"},
    {"backoff_cooldown": 2.5},
    [1, 2],
)


def soak_plan(n: int, seed: int, disconnect_share: float = SOAK_DISCONNECT_SHARE) -> list[RequestSpec]:
    """Mixed lengths: most prompts short, a quarter up to 1024 tokens, a few up to 2048; outputs of 1
    to 64 tokens. Half stream. A hanging-up client streams at least 32 tokens and leaves by halfway."""
    rng = random.Random(seed)
    plan = []
    for i in range(n):
        u = rng.random()
        prompt = rng.randint(1, 128) if u < 0.7 else rng.randint(129, 1024) if u < 0.95 else rng.randint(1025, 2048)
        max_tokens = rng.choice((1, 4, 16, 32, 64))
        stream = rng.random() < 0.5
        disconnect = None
        if rng.random() < disconnect_share:
            stream, max_tokens = True, max(max_tokens, 32)
            disconnect = rng.randint(1, max_tokens // 2)
        plan.append(RequestSpec(rng.random() < 0.5, stream, prompt, max_tokens, seed + i, disconnect))
    return plan


@dataclass
class PollStats:
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    problems: Counter[str] = field(default_factory=Counter)
    rounds: int = 0

    def count(self, what: str, r: httpx.Response, expected: int) -> None:
        self.statuses[(what, r.status_code)] += 1
        if r.status_code != expected:
            self.problems[f"{what}: {r.status_code}, expected {expected}"] += 1

    def summary(self) -> str:
        return ", ".join(f"{what} {status}: {n}" for (what, status), n in sorted(self.statuses.items()))


async def poll_controller(client: httpx.AsyncClient, stop: asyncio.Event) -> PollStats:
    """GET /metrics, GET /controller/state and PATCH /controller/config until `stop`; the valid PATCHes
    move one gain away from its value and back, the invalid ones must get a 400 and change nothing."""
    stats = PollStats()
    config = (await client.get("/controller/state")).json()["config"]
    original = {gain: config[gain] for gain in ALTERNATE_GAINS}
    while not stop.is_set():
        try:
            config = await _poll_round(client, stats, config, original)
        except (httpx.HTTPError, ValueError, LookupError) as e:  # no answer, or not the answer's shape
            stats.problems[f"{type(e).__name__}: {e}"] += 1
        stats.rounds += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_INTERVAL_S)
    stats.count("PATCH restore", await client.patch("/controller/config", json=original), 200)
    return stats


async def _poll_round(
    client: httpx.AsyncClient, stats: PollStats, config: dict[str, Any], original: dict[str, Any]
) -> dict[str, Any]:
    """One round of polling; the controller config in force after it."""
    stats.count("GET /metrics", await client.get("/metrics"), 200)
    stats.count("GET /controller/state", await client.get("/controller/state", params={"steps": 5}), 200)
    gain = list(ALTERNATE_GAINS)[(stats.rounds // 2) % len(ALTERNATE_GAINS)]
    value = ALTERNATE_GAINS[gain] if stats.rounds % 2 == 0 else original[gain]
    r = await client.patch("/controller/config", json={gain: value})
    stats.count("PATCH valid", r, 200)
    if r.status_code == 200:
        config = r.json()["config"]
    if stats.rounds % INVALID_PATCH_EVERY == 0:
        await _invalid_patch(client, stats, config)
    return config


async def _invalid_patch(client: httpx.AsyncClient, stats: PollStats, config: dict[str, Any]) -> None:
    patch = INVALID_PATCHES[(stats.rounds // INVALID_PATCH_EVERY) % len(INVALID_PATCHES)]
    r = await client.patch("/controller/config", json=patch)
    stats.count("PATCH invalid", r, 400)
    if r.status_code == 400 and (problem := openai_error_problem(r.json())):
        stats.problems[f"PATCH invalid: {problem}"] += 1
    after = (await client.get("/controller/state", params={"steps": 0})).json()["config"]
    if after != config:
        stats.problems[f"PATCH invalid {patch!r} changed the config"] += 1


@dataclass
class SoakRun:
    outcomes: list[Outcome]
    polls: PollStats
    rss_baseline_kib: int
    rss_end_kib: int
    counters: dict[str, Any]
    finished: dict[str, float]  # vllm:request_success_total by finished_reason
    seconds: float


async def _soak(server: ServerProcess, plan: list[RequestSpec], concurrency: int) -> SoakRun:
    baseline_at = max(1, len(plan) // 10)
    outcomes: list[Outcome | None] = [None] * len(plan)
    rss_baseline = 0
    done = 0
    indices: Iterator[int] = iter(range(len(plan)))

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done, rss_baseline
        for i in indices:
            outcomes[i] = await send(client, plan[i])
            done += 1
            if done == baseline_at:
                rss_baseline = server.rss_kib()

    t0 = time.monotonic()
    async with http.client(server.url, concurrency + 4, REQUEST_TIMEOUT_S) as client:
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_controller(client, stop))
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        seconds = time.monotonic() - t0
        stop.set()
        polls = await poller
        counters = await wait_idle(client)
        metrics = (await client.get("/metrics")).text
    finished = {
        s.labels["finished_reason"]: s.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "vllm:request_success"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert all(o is not None for o in outcomes)
    return SoakRun(outcomes, polls, rss_baseline, server.rss_kib(), counters, finished, seconds)  # type: ignore[arg-type]


def soak_checks(plan: list[RequestSpec], run: SoakRun) -> list[Check]:
    outcomes = run.outcomes
    hung_up = [o for o in outcomes if o.disconnected]
    rest = [o for o in outcomes if not o.disconnected]
    completed = sum(o.problem is None for o in rest)
    problems = count_problems(outcomes)
    statuses = Counter(o.status for o in outcomes) + Counter(status for (_, status) in run.polls.statuses.elements())
    server_errors = sum(n for s, n in statuses.items() if s >= 500)
    finished_total = sum(run.finished.values())
    tokens = sum(p.max_tokens for p, o in zip(plan, outcomes, strict=True) if not o.disconnected)
    c = run.counters
    growth = run.rss_end_kib / run.rss_baseline_kib - 1 if run.rss_baseline_kib else float("inf")
    return [
        Check(
            "soak: every request not hung up on completed, right token count",
            completed == len(rest),
            with_problems(
                f"{completed} of {len(rest)} completed ({tokens} tokens), {len(hung_up)} hung up on purpose, "
                f"{len(plan)} sent in {run.seconds:.0f} s",
                problems,
            ),
        ),
        Check(
            "soak: each request finished exactly once on the server",
            finished_total == len(plan) and run.finished.get("length", 0) >= completed,
            f"vllm:request_success_total {run.finished} (sum {finished_total:.0f}) for {len(plan)} requests",
        ),
        Check("soak: 0 responses 5xx", server_errors == 0, f"{server_errors} of {sum(statuses.values())} responses"),
        Check(
            "soak: /metrics, /controller/state, PATCH /controller/config polled all through",
            run.polls.rounds > 0 and not run.polls.problems,
            with_problems(f"{run.polls.rounds} rounds: {run.polls.summary()}", run.polls.problems),
        ),
        Check(
            "soak: injected OOMs all recovered",
            c["ooms"] > 0 and c["ooms_recovered"] == c["ooms"],
            f"{c['ooms']} OOM steps, {c['ooms_recovered']} recovered, of {c['steps']} steps",
        ),
        idle_check("soak: KV blocks back to 0", c),
        Check(
            f"soak: RSS within {RSS_GROWTH_LIMIT:.0%} of its value after the first tenth",
            growth <= RSS_GROWTH_LIMIT,
            f"{run.rss_baseline_kib / 1024:.1f} MiB after {max(1, len(plan) // 10)} requests, "
            f"{run.rss_end_kib / 1024:.1f} MiB at the end ({growth:+.1%})",
        ),
    ]


def run_soak(workdir: Path, requests: int, concurrency: int, seed: int) -> ScenarioResult:
    plan = soak_plan(requests, seed)
    flags = ["--inject-oom-rate", str(SOAK_OOM_RATE)]
    load_before, t0 = load_average(), time.monotonic()
    with headroom(flags, workdir / "soak-server.log", backend="twin") as server:
        run = asyncio.run(_soak(server, plan, concurrency))
        command = server.command
    notes = [
        f"{requests} requests from {concurrency} concurrent clients, seed {seed}: "
        f"{sum(p.stream for p in plan)} streaming, {sum(p.chat for p in plan)} chat, "
        f"{sum(p.disconnect_after is not None for p in plan)} hang up mid-stream; prompts of "
        f"{min(p.prompt_tokens for p in plan)} to {max(p.prompt_tokens for p in plan)} tokens, "
        f"{min(p.max_tokens for p in plan)} to {max(p.max_tokens for p in plan)} output tokens (ignore_eos)."
    ]
    return ScenarioResult(
        "Soak", command, soak_checks(plan, run), time.monotonic() - t0, load_before, load_average(), notes
    )


async def _overload(url: str, clients: int) -> tuple[list[Outcome], dict[str, Any]]:
    plan = [RequestSpec(False, i % 2 == 1, OVERLOAD_PROMPT_TOKENS, OVERLOAD_MAX_TOKENS, i) for i in range(clients)]
    async with http.client(url, clients + 4, REQUEST_TIMEOUT_S) as client:
        outcomes = await asyncio.gather(*(send(client, spec) for spec in plan))
        return list(outcomes), await wait_idle(client)


def overload_checks(outcomes: list[Outcome], counters: dict[str, Any], max_waiting: int) -> list[Check]:
    statuses = Counter(o.status for o in outcomes)
    refused = [o for o in outcomes if o.status == 429]
    admitted = [o for o in outcomes if o.status == 200]
    other = [o for o in outcomes if o.status not in (200, 429)]
    bad_refusals = Counter(
        f"Retry-After {o.retry_after!r}, {o.problem}" for o in refused
        if not o.openai_error or not (o.retry_after or "").isdigit()
    )  # fmt: skip
    return [
        Check(
            "overload: the queue overflowed",
            len(refused) > 0 and len(admitted) >= max_waiting,
            f"{len(outcomes)} clients at once against --max-waiting {max_waiting}: statuses {dict(statuses)}",
        ),
        Check(
            "overload: every refusal a 429 with Retry-After",
            not other and not bad_refusals,
            with_problems(
                f"{len(refused)} 429s, {len(refused) - sum(bad_refusals.values())} with Retry-After and an OpenAI "
                f"error; {len(other)} other non-200 answers",
                bad_refusals + count_problems(other),
            ),
        ),
        Check(
            "overload: every admitted request completed",
            all(o.problem is None for o in admitted),
            with_problems(
                f"{sum(o.problem is None for o in admitted)} of {len(admitted)} complete", count_problems(admitted)
            ),
        ),
        idle_check("overload: KV blocks back to 0", counters),
    ]


def run_overload(workdir: Path, max_waiting: int) -> ScenarioResult:
    clients = OVERLOAD_FACTOR * max_waiting
    load_before, t0 = load_average(), time.monotonic()
    with headroom(["--max-waiting", str(max_waiting)], workdir / "overload-server.log", backend="twin") as server:
        outcomes, counters = asyncio.run(_overload(server.url, clients))
        command = server.command
    notes = [
        f"{clients} non-streaming and streaming completions sent at once, {OVERLOAD_PROMPT_TOKENS} prompt and "
        f"{OVERLOAD_MAX_TOKENS} output tokens each (ignore_eos)."
    ]
    checks = overload_checks(outcomes, counters, max_waiting)
    return ScenarioResult("Overload", command, checks, time.monotonic() - t0, load_before, load_average(), notes)
