"""How far the 4090 twin is from what it was fitted to, recomputed from committed results.

- the seed matrix's concurrency-1 points (the twin's seed-static run, bench/results/twin_seed-static_64.json)
  beside the seed's single-stream table (profile [calibration]);
- the error statistics of that run, recomputed from the JSON, not copied from docs;
- the effect of the seed's KV admission rule (floor(tokens / 256) + 1 blocks) at the held-out misses,
  from two committed runs of the same points (--before: the JSON before the rule);
- which constants of each profile are fitted, and the fact that fixed each.

    .venv/bin/python bench/twin_fidelity.py --matrix bench/results/twin_seed-static_64.json \
        --before-commit e78227f --out bench/results/twin_fidelity.md
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from bench.report_io import write_report
from engine.twin.profile import DEFAULT_PROFILE, load_profile

ROOT = Path(__file__).resolve().parents[1]

# (label, calibration key, twin JSON key)
METRICS = [
    ("TTFT mean ms", "ttft_mean_ms", "mean_ttft_ms"),
    ("TTFT p99 ms", "ttft_p99_ms", "p99_ttft_ms"),
    ("TPOT mean ms", "tpot_mean_ms", "mean_tpot_ms"),
    ("ITL mean ms", "itl_mean_ms", "mean_itl_ms"),
    ("ITL p99 ms", "itl_p99_ms", "p99_itl_ms"),
    ("out tok/s", "out_tps", "output_throughput"),
    ("total tok/s", "total_tps", "total_token_throughput"),
]
HELD_OUT_MISSES = [(16, 256, 1024), (64, 256, 256), (64, 256, 1024)]

# Every fitted or assumed constant, with the fact that fixed it (the profile TOMLs say the same beside
# each value; docs/twin.md explains them).
CONSTANTS = [
    (
        "rtx4090-llama3.1-8b",
        "[overhead] step_ms",
        "fitted",
        "mean TPOT of the 9 single-stream rows minus the kernel sum: the mean residual",
    ),
    (
        "rtx4090-llama3.1-8b",
        "[overhead] prefill_knots_ms (32 / 256 / 4096 tokens)",
        "fitted",
        "mean TTFT at input 32 / 256 / 4096 (an LP minimising the largest relative TTFT error)",
    ),
    (
        "rtx4090-llama3.1-8b",
        "[overhead] per_max_token_us",
        "fitted",
        "TTFT rising with output length at every input (same LP); mechanism unknown",
    ),
    (
        "rtx4090-llama3.1-8b",
        "[memory] idle_workspace_bytes",
        "derived",
        "F1: idle 19515 + 32 N MiB minus weights and context",
    ),
    (
        "rtx4090-llama3.1-8b",
        "[memory] logits_dtype_bytes = 4",
        "chosen between facts",
        "F2: a lone 4096-token prefill passes at 64 blocks and fails at 80 (bf16 logits would pass at 80)",
    ),
    (
        "rtx4090-llama3.1-8b",
        "[memory] retain_previous_logits",
        "chosen between facts",
        "F7: back-to-back 4096 prefills fail without decode-first",
    ),
    (
        "rtx4090-llama3.1-8b",
        "[memory] prefill_seq_workspace_bytes = 42 MiB",
        "bracketed",
        "F3 (> 32.1 MiB) vs F5/F6 (< 61.7 MiB)",
    ),
    (
        "rtx4090-llama3.1-8b",
        "[device] cuda_context_bytes = 400 MiB",
        "assumed",
        "README range 300-430 MiB; split against the workspace not observable",
    ),
    (
        "seed policies",
        "kv_reserve_extra_tokens = 1 (floor(tokens/256)+1 blocks)",
        "mechanism, not fitted",
        "held-out misses at exactly the three KV-bound points whose input + output is a multiple of 256; moves "
        "no other point at 64 blocks",
    ),
    (
        "rtx4090-llama3.1-8b-vllm",
        "[overhead] all zero",
        "hypothesis, not fitted",
        "async scheduling overlaps CPU work; CUDA graphs remove decode launch gaps; GPU-bound at every batch",
    ),
    (
        "rtx4090-llama3.1-8b-vllm",
        "[engine] cuda_graph_sizes",
        "public fact",
        "vLLM's default capture list for max_num_seqs 256: 1, 2, 4, every 8 to 248, every 16 to 512",
    ),
    ("rtx4090-llama3.1-8b-vllm", "[engine] 2588 blocks of 16", "fact", "the held-out run's config"),
    (
        "rtx4090-llama3.1-8b-vllm",
        "[memory] idle_workspace_bytes",
        "derived",
        "gpu_memory_utilization 0.9 of 24564 MiB minus context, weights and 2588 blocks",
    ),
]


def key(p: dict) -> tuple[int, int, int]:
    return p["concurrency"], p["input_len"], p["output_len"]


def rel(twin: float, seed: float) -> float:
    return (twin - seed) / seed


def single_stream(points: dict, rows: list[dict]) -> tuple[list[str], dict[str, list[float]]]:
    header = "| in | out | " + " | ".join(f"{m[0]} seed / twin / err" for m in METRICS) + " |"
    lines = [header, "|---|---|" + "---|" * len(METRICS)]
    errors: dict[str, list[float]] = {m[0]: [] for m in METRICS}
    for r in rows:
        p = points[(1, r["input"], r["output"])]
        cells = []
        for label, ck, tk in METRICS:
            e = rel(p[tk], r[ck])
            errors[label].append(e)
            cells.append(f"{r[ck]:.2f} / {p[tk]:.2f} / {e:+.1%}")
        lines.append(f"| {r['input']} | {r['output']} | " + " | ".join(cells) + " |")
    return lines, errors


def error_stats(errors: dict[str, list[float]]) -> list[str]:
    lines = ["| metric | mean signed | mean abs | RMS | max abs |", "|---|---|---|---|---|"]
    for label, es in errors.items():
        mean = sum(es) / len(es)
        mabs = sum(map(abs, es)) / len(es)
        rms = math.sqrt(sum(e * e for e in es) / len(es))
        lines.append(f"| {label} | {mean:+.2%} | {mabs:.2%} | {rms:.2%} | {max(map(abs, es)):.2%} |")
    return lines


def before_after(before: dict, after: dict) -> list[str]:
    lines = [
        "| point | requests | out tok/s before | after | change | TPOT mean ms before | after |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in HELD_OUT_MISSES:
        b, a = before[k], after[k]
        lines.append(
            f"| {k} | {a['num_prompts']} | {b['output_throughput']:.1f} | {a['output_throughput']:.1f} | "
            f"{rel(a['output_throughput'], b['output_throughput']):+.1%} | {b['mean_tpot_ms']:.2f} | "
            f"{a['mean_tpot_ms']:.2f} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--matrix", type=Path, required=True, help="the twin's seed-static matrix JSON")
    ap.add_argument("--before-commit", required=True, help="commit holding the same JSON before the KV rule")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    doc = json.loads(args.matrix.read_text())
    points = {key(p): p for p in doc["points"]}
    rel_path = args.matrix.resolve().relative_to(ROOT)
    old = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{args.before_commit}:{rel_path}"], capture_output=True, text=True, check=True
    ).stdout
    before = {key(p): p for p in json.loads(old)["points"]}
    rows = load_profile(DEFAULT_PROFILE).section("calibration")["single_stream"]
    table, errors = single_stream(points, rows)
    changes = [rel(points[k]["output_throughput"], before[k]["output_throughput"]) for k in HELD_OUT_MISSES]
    lo, hi = 1.18 * (1 + min(changes)) - 1, 1.26 * (1 + max(changes)) - 1
    lines = [
        "# Twin fidelity (RTX 4090 + Llama-3.1-8B)",
        "",
        f"Command: `python bench/twin_fidelity.py {' '.join(sys.argv[1:])}`. Twin run: `{doc['command']}`.",
        "",
        "## Concurrency 1: the seed's single-stream table beside the twin",
        "",
        "Errors are (twin - seed) / seed. The seed's p99 comes from run-to-run spread the twin does not model "
        "(it is deterministic: p99 TTFT = mean TTFT).",
        "",
        *table,
        "",
        "## Error statistics of the matrix run (concurrency 1, the rows with seed numbers in the repository)",
        "",
        *error_stats(errors),
        "",
        "Concurrency 4, 16 and 64: the seed's numbers are held out of the repository (issue #16), so no error "
        "is computed here. The issue reports that, with the seed's request counts, 17 of the 21 held-out rows "
        "agreed within 15 % and names the 4 misses; the next section is what the twin now does at three of "
        "them.",
        "",
        "## The seed's KV admission rule at the held-out misses",
        "",
        "The seed sizes a request as floor(tokens / 256) + 1 blocks, one more than ceil where input + output "
        "is a multiple of 256. Of the 30 points at the seed's 64 blocks, that changes only the KV-bound ones "
        "with such a total: (16, 256, 1024), (64, 256, 256), (64, 256, 1024), exactly the three steady-state "
        f"misses where the twin was 18-26 % too fast. Same requests before (commit {args.before_commit}) and "
        "after:",
        "",
        *before_after(before, points),
        "",
        f"If the twin was 18 % to 26 % too fast there, these changes put it between {lo:+.0%} and {hi:+.0%} "
        "of the seed. That is arithmetic on the issue's range, not a measurement: the held-out rows are not "
        "here. At 80 blocks (no seed measurements there) the rule also turns seed-static's OOM at (16, 256, "
        "1024) and (64, 256, 1024) into a pass: 13 requests are admitted instead of 16, so the back-to-back "
        "prefills are 8 + 5 prompts (1839 MiB with the first one's logits) instead of 8 + 8 (2340 MiB, over "
        "the 2006 MiB free).",
        "",
        "## Which constants are fitted, and what fixed each",
        "",
        "| profile | constant | kind | fixed by |",
        "|---|---|---|---|",
        *[f"| {p} | {c} | {k} | {f} |" for p, c, k, f in CONSTANTS],
    ]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
