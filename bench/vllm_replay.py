"""A 300-request ShareGPT-like trace at 10 requests/s on the vLLM 0.19 twin, replayed under vLLM's own
scheduling rules (`--policy vllm`) and under the adaptive controller, on the same twin and arrivals.

Writes the seeded trace (vLLM's per-request JSONL) beside the report, runs `headroom bench replay` once
per policy, and checks the issue's acceptance for the vllm run: 0 failed, 0 OOMs, under 60 s of wall
time. All latencies are twin numbers (virtual time):

    python -m bench.vllm_replay --out bench/results/vllm_replay.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.cli import replay_doc, write_run
from bench.harness.report import Stamp, write_report
from bench.harness.twin_flags import add_twin_sensors, twin_argv
from bench.report import LATENCIES, PERCENTILES, latency_table
from bench.synthetic import sharegpt_like_trace, write_trace
from engine.cli import engine_config

PROFILE = "rtx4090-llama3.1-8b-vllm"
POLICIES = ("vllm", "adaptive")
WALL_LIMIT_S = 60.0


def replay(trace: Path, policy: str, out: Path, stamp: Stamp, twin: list[str]) -> dict:
    """`headroom bench replay` on the trace under `policy`, its JSON and table written to `out`."""
    flags = [*twin[2:], "--profile", PROFILE, "--policy", policy]
    doc = replay_doc(engine_config([*twin[:2], *flags]), trace)
    write_run(out, doc, stamp, latency_table(doc["points"][0]))  # type: ignore[index]
    command = ["headroom", "bench", "replay", *flags, "--trace", str(trace), "--out", str(out)]
    return {"command": " ".join(command), "wall_s": doc["wall_s"], **doc["points"][0]}  # type: ignore[index]


def table(runs: dict[str, dict]) -> list[str]:
    lines = ["| metric | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]

    def row(label: str, fmt: str, key: str) -> None:
        lines.append(f"| {label} | " + " | ".join(fmt.format(r[key]) for r in runs.values()) + " |")

    for label, key in (
        ("KV pool, blocks of 16 (largest)", "kv_pool_peak_blocks"),
        ("completed", "completed"),
        ("failed", "failed"),
        ("OOMs", "ooms"),
        ("preemptions", "preemptions"),
        ("engine steps", "steps"),
    ):
        row(label, "{}", key)
    row("duration (virtual s)", "{:.1f}", "duration")
    row("output tok/s", "{:.1f}", "output_throughput")
    row("total tok/s", "{:.1f}", "total_token_throughput")
    for label, key in LATENCIES:
        for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES)):
            row(f"{label} {stat} ms", "{:.2f}", f"{stat}_{key}_ms")
    row("wall time of the replay (s)", "{:.2f}", "wall_s")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="markdown report; trace and runs go beside it")
    add_twin_sensors(ap)
    args = ap.parse_args()
    stamp = Stamp("python -m bench.vllm_replay")
    stem = args.out.with_suffix("")
    trace = stem.parent / "sharegpt_like_300.jsonl"
    records = sharegpt_like_trace()
    write_trace(trace, records)
    runs = {p: replay(trace, p, Path(f"{stem}_{p}.json"), stamp, twin_argv(args)) for p in POLICIES}
    v = runs["vllm"]
    holds = v["failed"] == 0 and v["ooms"] == 0 and v["wall_s"] < WALL_LIMIT_S
    ins = [r["input_toks"] for r in records]
    outs = [r["output_toks"] for r in records]
    span = records[-1]["arrival_time"] - records[0]["arrival_time"]
    lines = [
        "# A ShareGPT-like trace on the vLLM 0.19 twin: vLLM's rules against the adaptive controller",
        "",
        *[f"- `{r['command']}`" for r in runs.values()],
        "",
        f"Trace `{trace.name}` (bench/synthetic.py, seed 0): {len(records)} requests over {span:.1f} s "
        f"(Poisson, {len(records) / span:.1f}/s), input tokens mean {sum(ins) / len(ins):.0f} (max {max(ins)}), "
        f"output tokens mean {sum(outs) / len(outs):.0f} (max {max(outs)}). Twin profile `{PROFILE}`. KV pool: "
        "vllm has the held-out run's 2588 blocks of 16 (41,408 tokens, `gpu_memory_utilization` 0.9); adaptive "
        "has no `--num-blocks`, so the controller sizes its pool at start-up from what its profiling steps "
        "measured (engine/core/kv/sizing.py) and resizes it online. Prefix caching is on for both (as in the held-out "
        "run): the trace's prompts share nothing, so the hits are a preempted request's own blocks when it is "
        "recomputed. Latencies are twin numbers (virtual time). At 10 requests/s this load is far beyond what "
        "either pool serves, so TTFT is queueing.",
        "",
        f"Acceptance (vllm: 0 failed, 0 OOMs, wall < {WALL_LIMIT_S:.0f} s): {'holds' if holds else 'FAILS'}.",
        "",
        *table(runs),
    ]
    write_report(args.out, lines, stamp)


if __name__ == "__main__":
    main()
