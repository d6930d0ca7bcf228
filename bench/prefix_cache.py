"""Prefix caching on a multi-turn chat: the real server (default model, CPU) once with the cache
and once with `--no-enable-prefix-caching`, the same conversations against each.

Each conversation shares one system prompt and resends its whole history every turn plus a new user
message, as a chat client does; conversations run concurrently, turns within one in order. TTFT is measured
per turn with streaming (request sent to first content chunk). Greedy answers, so both runs see the same
conversations. Writes bench/results/prefix_cache.md with the command, CPU, flags, load average, TTFT per
setting and their ratio, and the hit rate from /metrics.

    python -m bench.prefix_cache [--conversations 4] [--turns 5] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.harness import http
from bench.harness.machine import load_average, machine_line
from bench.harness.report import Stamp, write_report
from bench.harness.server import headroom

SYSTEM_PROMPT = (
    "You are Atlas, the support assistant of Northwind Outfitters, an online shop for hiking and camping gear. "
    "Answer in a friendly, concise way and stay on topic. Policies you must follow: orders ship within two "
    "business days from our warehouse in Denver; standard shipping is free above 75 dollars, otherwise it costs "
    "6.95; express shipping costs 19.95 and arrives in two days. Returns are accepted within 60 days if the item "
    "is unused and in its original packaging; worn footwear can be returned within 30 days only if it is "
    "defective. Refunds go to the original payment method within 5 business days of the return arriving. Tents, "
    "sleeping bags and stoves carry a two-year warranty against manufacturing defects; we do not cover damage "
    "from misuse, fire or animals. Never promise discounts, never ask for full card numbers or passwords, and "
    "hand the customer to a human agent if they ask for one or if the question is about a legal dispute. When "
    "you do not know an answer, say so and offer to open a ticket. Keep each answer under five sentences."
)
TOPICS = [
    ["My tent pole snapped on the second trip. Is that covered?", "I bought it 14 months ago.",
     "How do I send it in?", "Can I get a replacement before I send the old one?", "What if it breaks again?",
     "Thanks. Can you summarise what happens next?"],
    ["I want to return hiking boots I wore once.", "They gave me blisters, is that a defect?",
     "What about the unworn pair of socks in the same order?", "How long until I see the refund?",
     "Can the refund go to store credit instead?", "Please summarise my options."],
    ["Does my order of 62 dollars ship for free?", "What if I add a 15 dollar headlamp?",
     "When would it arrive with express shipping?", "I live in Alaska, does that change anything?",
     "Can I change the address after ordering?", "Summarise the cheapest way to get it by Friday."],
    ["Which stove is best for winter camping?", "Does the warranty cover a cracked burner?",
     "I left it too close to the fire, is that covered?", "Can you give me a discount for the trouble?",
     "I want to talk to a human.", "Before that, summarise what you told me."],
]  # fmt: skip


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    ttft_s: float


@dataclass
class Setting:
    name: str
    flags: list[str]
    command: str = ""
    turns: list[Turn] = field(default_factory=list)
    load_before: str = ""
    load_after: str = ""
    queries: float = 0.0
    hits: float = 0.0
    wall_s: float = 0.0

    def ttfts(self) -> list[float]:
        return [t.ttft_s for t in self.turns]


async def stream_turn(client: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> tuple[float, str, int]:
    """(TTFT in seconds, the answer, prompt tokens) of one streamed chat completion."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    a = await http.request(client, "/v1/chat/completions", body)
    if a.status != 200 or not a.token_times:
        raise RuntimeError(f"the stream sent no content (status {a.status}, errors {a.errors})")
    return a.ttft, a.text, a.usage["prompt_tokens"] if a.usage else 0


async def conversation(client: httpx.AsyncClient, index: int, turns: int, max_tokens: int) -> list[Turn]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    out = []
    for turn, question in enumerate(TOPICS[index % len(TOPICS)][:turns]):
        messages.append({"role": "user", "content": question})
        ttft, answer, prompt_tokens = await stream_turn(client, messages, max_tokens)
        messages.append({"role": "assistant", "content": answer})
        out.append(Turn(index, turn, prompt_tokens, ttft))
    return out


def counter(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))


async def drive(url: str, conversations: int, turns: int, max_tokens: int) -> list[Turn]:
    async with http.client(url) as client:
        runs = await asyncio.gather(*(conversation(client, i, turns, max_tokens) for i in range(conversations)))
    return [t for run in runs for t in run]


def run_setting(setting: Setting, args: argparse.Namespace, workdir: Path) -> None:
    server = headroom(setting.flags, workdir / f"{setting.name}.log", backend="torch")
    setting.command = server.command
    with server:
        setting.load_before, t0 = load_average(), time.monotonic()
        setting.turns = asyncio.run(drive(server.url, args.conversations, args.turns, args.max_tokens))
        setting.wall_s = time.monotonic() - t0
        setting.load_after = load_average()
        metrics = httpx.get(server.url + "/metrics", timeout=60).text
    setting.queries = counter(metrics, "vllm:prefix_cache_queries_total")
    setting.hits = counter(metrics, "vllm:prefix_cache_hits_total")


def summary_row(s: Setting) -> str:
    ttfts = s.ttfts()
    later = [t.ttft_s for t in s.turns if t.turn > 0]
    rate = f"{s.hits / s.queries:.1%}" if s.queries else "-"
    return (f"| {s.name} | {len(ttfts)} | {statistics.mean(ttfts) * 1e3:.0f} | {statistics.median(ttfts) * 1e3:.0f} "
            f"| {statistics.mean(later) * 1e3:.0f} | {rate} ({s.hits:.0f} / {s.queries:.0f} tokens) "
            f"| {s.wall_s:.0f} | {s.load_before} -> {s.load_after} |")  # fmt: skip


def per_turn_rows(on: Setting, off: Setting, turns: int) -> list[str]:
    rows = ["| turn | prompt tokens (mean) | TTFT mean with cache, ms | without, ms | ratio |", "|---|---|---|---|---|"]
    for turn in range(turns):
        a = [t for t in on.turns if t.turn == turn]
        b = [t for t in off.turns if t.turn == turn]
        mean_on, mean_off = statistics.mean(t.ttft_s for t in a), statistics.mean(t.ttft_s for t in b)
        tokens = statistics.mean(t.prompt_tokens for t in a)
        rows.append(f"| {turn + 1} | {tokens:.0f} | {mean_on * 1e3:.0f} | {mean_off * 1e3:.0f} "
                    f"| {mean_off / mean_on:.2f}x |")  # fmt: skip
    return rows


def report(on: Setting, off: Setting, args: argparse.Namespace) -> list[str]:
    ratio_mean = statistics.mean(off.ttfts()) / statistics.mean(on.ttfts())
    ratio_p50 = statistics.median(off.ttfts()) / statistics.median(on.ttfts())
    return [
        "# Prefix caching: multi-turn chat TTFT",
        "",
        f"{machine_line()} Shared with other work while this ran (load average of each setting in the table).",
        "",
        f"Servers: `{on.command}` and `{off.command}` (default model, CPU, every other flag at its default).",
        "",
        f"Workload: {args.conversations} conversations at once, {args.turns} turns each, one shared system prompt; "
        f"each turn resends the whole conversation plus a new user message (greedy, at most {args.max_tokens} "
        "tokens an answer), streamed; TTFT from sending the request to the first content chunk.",
        "",
        "| setting | turns | TTFT mean ms | TTFT p50 ms | TTFT mean ms, turns 2+ | prefix cache hit rate (/metrics) "
        "| wall s | load average before -> after |",
        "|---|---|---|---|---|---|---|---|",
        summary_row(on),
        summary_row(off),
        "",
        f"TTFT without the cache / with it: mean {ratio_mean:.2f}x, p50 {ratio_p50:.2f}x (target: at least 2x). "
        "The settings ran one after the other on shared CPUs, so a change of load between them moves the "
        "ratio; the first turn has nothing cached yet (the conversations start together).",
        "",
        *per_turn_rows(on, off, args.turns),
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=5, choices=range(1, len(TOPICS[0]) + 1))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default="bench/results/prefix_cache.md")
    args = p.parse_args(argv)
    stamp = Stamp("python -m bench.prefix_cache", argv)
    with tempfile.TemporaryDirectory(prefix="prefix-cache-") as tmp:
        on = Setting("prefix caching on (default)", ["--device", "cpu"])
        off = Setting("--no-enable-prefix-caching", ["--device", "cpu", "--no-enable-prefix-caching"])
        for setting in (on, off):
            run_setting(setting, args, Path(tmp))
    data = {s.name: [t.__dict__ for t in s.turns] for s in (on, off)}
    write_report(args.out, report(on, off, args), stamp, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
