"""The Ray Serve fleet on 4 twin replicas, Ray's default router and the headroom router: a smoke test of the
wiring (Ray, the ingress, the router, the replicas' stats) in wall time, not a comparison of routers. With Ray, the
replicas, the ingress and the client on two shared cores it measures the machine as much as the router; the
routers are compared in virtual time by `headroom bench fleet` (bench/fleet/, bench/results/fleet.md).

Open loop, seeded, the same schedule for both routers: chat requests (Poisson, ~200-token prompts, 32 output
tokens) and 8192-token prompts (Poisson, 16 output tokens), every request streamed. Each router gets its own
fleet, started with `headroom serve --backend twin --replicas N --router R` (the twin sleeps its modelled step
times, so latencies are twin latencies in wall time) and stopped afterwards. Measured at the client: TTFT
(first streamed content), completed requests and output tokens per second over the run, errors, and which
replica served each long prompt (the `x-headroom-replica` header); OOMs from the fleet's /metrics.

    .venv/bin/python -m bench.ray_fleet --out bench/results/ray_fleet.md
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

from bench.harness import http
from bench.harness.machine import load_average, machine_line
from bench.harness.report import Stamp, write_report
from bench.harness.server import headroom
from engine.serving.ray_serve.forwarding import REPLICA_HEADER

READY = re.compile(r"Headroom ready at (http://\S+)")
START_TIMEOUT_S = 300
CHAT_CHARS, CHAT_TOKENS = 800, 32  # ~200 prompt tokens (the twin's stand-in tokenizer: 4 characters a token)
LONG_CHARS, LONG_TOKENS = 4 * 8192 - 40, 16  # 8192 prompt tokens with the chat template


@dataclass(frozen=True)
class Planned:
    at: float  # seconds after the start
    kind: str  # chat | long


@dataclass
class Outcome:
    kind: str
    status: int = 0
    replica: str | None = None
    ttft: float | None = None
    tokens: int = 0
    error: str | None = None


def schedule(seed: int, duration: float, chat_rate: float, long_rate: float) -> list[Planned]:
    rng = random.Random(seed)
    planned: list[Planned] = []
    for kind, rate in (("chat", chat_rate), ("long", long_rate)):
        t = rng.expovariate(rate)
        while t < duration:
            planned.append(Planned(t, kind))
            t += rng.expovariate(rate)
    return sorted(planned, key=lambda p: p.at)


async def one(client: httpx.AsyncClient, plan: Planned, index: int) -> Outcome:
    chars, tokens = (CHAT_CHARS, CHAT_TOKENS) if plan.kind == "chat" else (LONG_CHARS, LONG_TOKENS)
    text = f"{index} " + "x" * chars  # distinct prompts
    body = {"model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
            "stream": True, "ignore_eos": True}  # fmt: skip
    out = Outcome(plan.kind)
    try:
        a = await http.request(client, "/v1/chat/completions", body)
    except httpx.HTTPError as e:
        out.error = type(e).__name__
        return out
    assert a.response is not None
    out.status, out.replica = a.status, a.response.headers.get(REPLICA_HEADER.decode())
    out.tokens = len(a.token_times)
    out.ttft = a.ttft if a.token_times else None
    if a.errors:
        out.error = a.errors[-1].get("code") or a.errors[-1]["type"]
    elif a.status != 200:
        out.error = f"http {a.status}"
    return out


async def drive(url: str, planned: list[Planned]) -> tuple[list[Outcome], float]:
    async with http.client(url, connections=1000) as client:
        start = time.monotonic()

        async def at(plan: Planned, index: int) -> Outcome:
            await asyncio.sleep(max(0.0, start + plan.at - time.monotonic()))
            return await one(client, plan, index)

        outcomes = await asyncio.gather(*(at(p, i) for i, p in enumerate(planned)))
        return list(outcomes), time.monotonic() - start


def fleet_ooms(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text  # Prometheus text, not JSON
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("headroom_ooms_total{"))


def run_router(router: str, replicas: int, planned: list[Planned]) -> dict:
    flags = ["--replicas", str(replicas), "--router", router, "--log-level", "warning"]
    with tempfile.TemporaryDirectory(prefix="ray-fleet-") as tmp:
        log = Path(tmp) / "fleet.log"
        with headroom(flags, log, backend="twin", start_timeout=START_TIMEOUT_S, stop_timeout=120) as server:
            time.sleep(5)  # every replica has published its stats and metrics
            outcomes, makespan = asyncio.run(drive(server.url, planned))
            time.sleep(2)  # the last metrics push
            ooms = fleet_ooms(server.url)
    return summarize(router, outcomes, makespan, ooms)


def summarize(router: str, outcomes: list[Outcome], makespan: float, ooms: float) -> dict:
    def ttft(kind: str) -> list[float]:
        return [o.ttft * 1e3 for o in outcomes if o.kind == kind and o.ttft is not None and o.error is None]

    ok = [o for o in outcomes if o.error is None and o.status == 200]
    row: dict = {"router": router, "requests": len(outcomes), "completed": len(ok),
                 "errors": dict(Counter(o.error for o in outcomes if o.error)), "ooms": ooms,
                 "makespan_s": makespan, "req_per_s": len(ok) / makespan,
                 "out_tok_per_s": sum(o.tokens for o in ok) / makespan}  # fmt: skip
    for kind in ("chat", "long"):
        values = ttft(kind)
        for p in (50, 99):
            row[f"{kind}_ttft_p{p}_ms"] = float(np.percentile(values, p)) if values else float("nan")
    all_ttft = ttft("chat") + ttft("long")
    row["ttft_p50_ms"], row["ttft_p99_ms"] = (float(np.percentile(all_ttft, p)) for p in (50, 99))
    row["long_per_replica"] = sorted(Counter(o.replica for o in outcomes if o.kind == "long").values(), reverse=True)
    row["outcomes"] = [asdict(o) for o in outcomes]
    return row


def report(args: argparse.Namespace, rows: list[dict], machine: str) -> list[str]:
    cols = ("router", "requests", "completed", "errors", "ooms", "req_per_s", "out_tok_per_s", "ttft_p50_ms",
            "ttft_p99_ms", "chat_ttft_p50_ms", "chat_ttft_p99_ms", "long_ttft_p50_ms", "long_ttft_p99_ms",
            "long_per_replica")  # fmt: skip
    lines = [
        "# Ray Serve fleet: a smoke test of the wiring, default and headroom routers (twin, wall time)",
        "",
        f"{args.replicas} twin replicas (RTX 4090 + Llama-3.1-8B, realtime), {args.duration:.0f} s open loop, seed "
        f"{args.seed}: chat at {args.chat_rate}/s (~200-token prompts, {CHAT_TOKENS} out), 8192-token prompts at "
        f"{args.long_rate}/s ({LONG_TOKENS} out), all streamed. TTFT in ms at the client. Machine: 2 shared CPU "
        "cores for Ray, the replicas, the ingress and the client.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for row in rows:
        cells = [f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    by = {row["router"]: row for row in rows}
    if {"default", "headroom"} <= by.keys():
        d, h = by["default"], by["headroom"]
        ratios = ", ".join(f"{name} {d[f'{key}ttft_p99_ms'] / h[f'{key}ttft_p99_ms']:.2f}x"
                           for name, key in (("all", ""), ("chat", "chat_"), ("long", "long_")))  # fmt: skip
        lines += [
            "",
            f"TTFT p99, default / headroom: {ratios}; output tok/s "
            f"{d['out_tok_per_s']:.1f} vs {h['out_tok_per_s']:.1f}; OOMs {d['ooms']:.0f} vs {h['ooms']:.0f}.",
            "",
            "One run per router, one seed, on 2 CPU cores shared with other work: a check that the fleet serves and "
            "routes, not a comparison of routers (that is bench/results/fleet.md, in virtual time). "
            "long_per_replica: the 8192-token prompts each replica served, most first. Raw outcomes: "
            "the .json beside this file.",
        ]
    return [*lines, "", machine]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--chat-rate", type=float, default=6.0, help="chat requests per second")
    p.add_argument("--long-rate", type=float, default=1.0, help="8192-token prompts per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routers", nargs="+", default=["default", "headroom"], choices=["default", "headroom"])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    stamp = Stamp("python -m bench.ray_fleet", argv)
    planned = schedule(args.seed, args.duration, args.chat_rate, args.long_rate)
    load_before = load_average()
    rows = [run_router(router, args.replicas, planned) for router in args.routers]
    write_report(args.out, report(args, rows, machine_line(load_before)), stamp, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
