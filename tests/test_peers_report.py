"""bench/peers_report.py: figures as medians with their range over the rounds, and each ratio to the better
peer taken within a round (the servers of a round ran minutes apart), so its worst round is visible."""

from __future__ import annotations

from bench.peers_report import Round, Run, ServerResult, per_round, report, spread


def server(name: str, rates: list[float], tpots: list[float], bandwidth: float = 30e9) -> ServerResult:
    res = ServerResult(name, f"{name} serve", step_bytes=90_000_000)
    for rate, tpot in zip(rates, tpots, strict=True):
        result = {"output_throughput": rate, "mean_tpot_ms": tpot, "mean_ttft_ms": 50.0, "completed": 8}
        res.rounds.append(Round(bandwidth, {1: Run(1, 8, result)}, rss_end_mib=900.0, load="0.5 0.5 0.5"))
    return res


def test_spread_is_the_median_and_the_range() -> None:
    assert spread([3.0, 1.0, 2.0]) == "2.0 (1.0-3.0)"
    assert spread([4.25], ".2f") == "4.25"
    assert spread([]) == "-"


def test_ratios_are_taken_round_by_round_against_the_better_peer() -> None:
    ours = server("headroom", [150, 120, 160], [5, 6, 5])
    llama = server("llama.cpp", [100, 100, 80], [9, 9, 10])
    vllm = server("vllm", [50, 110, 60], [20, 20, 20])

    def rate(r: ServerResult, i: int) -> float | None:
        return r.rounds[i].runs[1].result["output_throughput"]

    # round 2: vLLM is the better peer (110), not llama.cpp; the median of per-round ratios, not of medians
    assert per_round([ours, llama, vllm], rate) == [1.5, 120 / 110, 2.0]


def test_the_report_holds_the_bound_ratio_and_the_tpot_ratio_to_llama_cpp() -> None:
    ours = server("headroom", [150, 120, 160], [6.0, 6.0, 3.0])
    llama = server("llama.cpp", [100, 100, 80], [10.0, 12.0, 10.0])
    text = "\n".join(report([ours, llama], [(1, 8)], ["# t"]))
    bound = 1e3 * 90_000_000 / 30e9  # 3 ms
    assert f"{6.0 / bound:.2f}, {6.0 / bound:.2f}, {3.0 / bound:.2f}" in text
    assert "Headroom's single-stream TPOT over llama.cpp's, round by round: 0.60, 0.50, 0.30." in text
    assert "| 1 (8) | 150.0 (120.0-160.0) | 100.0 (80.0-100.0) | 1.50 (worst 1.20) |" in text
