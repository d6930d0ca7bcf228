"""How far the 4090 twin is from what it was fitted to, recomputed from committed results.

- the seed matrix's concurrency-1 points (the twin's seed-static run, bench/results/twin_seed-static_64.json)
  beside the seed's single-stream table (profile [calibration]);
- the error statistics of that run, recomputed from the JSON, not copied from docs;
- the effect of the seed's KV admission rule (floor(tokens / 256) + 1 blocks) at the held-out misses,
  from two committed runs of the same points (--before: the JSON before the rule);
- the arithmetic behind the unexplained (4, 4096, 256) miss: the twin's in=4096 points, what the seed's
  single-stream ratios do and do not say about prompt lengths, and the bound the seed-static rules set;
- which constants of each profile are fitted, and the fact that fixed each.

    python -m bench.twin_fidelity --matrix bench/results/twin_seed-static_64.json \
        --before-commit e78227f --out bench/results/twin_fidelity.md
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

from bench.harness.report import Stamp, write_report
from bench.seed_matrix import load_matrix, matrix_points
from engine.backends.twin.profile import DEFAULT_PROFILE, load_profile

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
SEED_BLOCKS, SEED_BLOCK_TOKENS = 64, 256
BANDWIDTH_FLOOR_MS = 14.9  # calibration README: ~15.0 GB read per decode step / 1008 GB/s
LONG_MISS_REQUESTS = 40  # the seed's count at concurrency 4

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
        "SeedRules: one slot reserved past input + output (floor(tokens/256)+1 blocks)",
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
        "vllm policy",
        "VllmScheduler: the newest running request is the victim",
        "public fact",
        "vLLM v1's scheduler preempts `self.running.pop()` (the newest running request) when a decode finds no block",
    ),
    (
        "rtx4090-llama3.1-8b-vllm",
        "[memory] idle_workspace_bytes",
        "derived",
        "gpu_memory_utilization 0.9 of 24564 MiB minus context, weights and 2588 blocks",
    ),
]

# Candidate mechanisms for the (4, 4096, 256) miss and the fact each conflicts with (docs/twin.md).
LONG_MISS_CANDIDATES = [
    (
        "random-dataset prompts below 4096 tokens as the seed counts them (neither held back nor capped)",
        "F4 + F6: such a prompt joins a 4096-token one in one prefill step and the logits (2 x 2004 MiB) OOM "
        "(twin: every mix tried, even one such prompt in 40); the same prompts run at (4, 4096, 1024), "
        "where 3 requests fit too, and that point agrees with the serial twin",
    ),
    (
        "threshold strict (> 4096) or counted without BOS: no prompt is long",
        "F3/F4/F7: decode-first removed the OOM at (4, 4096, 1024), so the long rules acted there; F6",
    ),
    (
        "a decode step between long prefills",
        "with the stated long cap on decode batches: no gain (twin: 50.06 and 53.91 unchanged); without it: "
        "OOM after a decode of 3 (F6/F7), and (4, 4096, 1024) would rise as much",
    ),
    ("KV admission floor(tokens / 256) + 1", "18 and 21 blocks: 3 fit at out 256 and at out 1024 alike"),
    ("cost of a long prefill beside 3 decodes", "the seed never shares a step; extra cost only slows the twin"),
    ("a deferred long prompt released after a fixed wait", "would raise (4, 4096, 1024) more; a fitted knob"),
    (
        "the client counting twice the output tokens (it re-tokenises the generated text when the server "
        "reports no usage): the engine serial, out tok/s doubled, mean TPOT halved to about 9 ms",
        "the same prompts at concurrency 1 count about 255 tokens; under the stated rules each request runs "
        "alone at concurrency 4 too, in the same steps, so its text, and its count, would be the same",
    ),
]


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


def long_prompt_points(points: dict) -> list[str]:
    """The twin at in=4096: concurrency 4 against 1, and how many requests the seed's KV rule admits."""
    lines = [
        "| out | blocks a request (floor + 1) | fit in 64 | twin out tok/s con 1 | con 4 | con 4 / con 1 |",
        "|---|---|---|---|---|---|",
    ]
    for out in (256, 1024, 4096):
        one, four = points[(1, 4096, out)], points[(4, 4096, out)]
        blocks = (4096 + out) // SEED_BLOCK_TOKENS + 1
        lines.append(
            f"| {out} | {blocks} | {SEED_BLOCKS // blocks} | {one['output_throughput']:.2f} | "
            f"{four['output_throughput']:.2f} | {four['output_throughput'] / one['output_throughput']:.3f} |"
        )
    return lines


def implied_lengths(rows: list[dict]) -> list[str]:
    """What total / out tok/s implies about the client-counted prompt, with the interval the table's rounding
    (two decimals) allows, and the output count it implies if the client counted input - 1 tokens."""
    lines = [
        "| in | out | total / out | implied mean prompt (rounding interval) | implied output if prompt = in - 1 |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        tot, out_tps, i, o = r["total_tps"], r["out_tps"], r["input"], r["output"]
        ratio = tot / out_tps
        lo, hi = o * ((tot - 0.005) / (out_tps + 0.005) - 1), o * ((tot + 0.005) / (out_tps - 0.005) - 1)
        lines.append(
            f"| {i} | {o} | {ratio:.5f} | {o * (ratio - 1):.2f} ({lo:.2f} - {hi:.2f}) | {(i - 1) / (ratio - 1):.2f} |"
        )
    return lines


def serial_bound(rows: list[dict]) -> list[str]:
    """Seed-static's ceiling at (4, 4096, 256) from the seed's own single-stream row, and what twice it needs."""
    r = next(r for r in rows if (r["input"], r["output"]) == (4096, 256))
    per_request = r["ttft_mean_ms"] + (r["output"] - 1) * r["tpot_mean_ms"]
    bound = r["output"] / per_request * 1000
    tokens = LONG_MISS_REQUESTS * r["output"]
    duration = tokens / (2 * bound)
    decode_s = duration - LONG_MISS_REQUESTS * r["ttft_mean_ms"] / 1000
    floor_steps, seed_steps = decode_s * 1000 / BANDWIDTH_FLOOR_MS, decode_s * 1000 / r["tpot_mean_ms"]
    return [
        f"Under the stated rules, each request runs alone: its prefill step, then {r['output']} decode steps with no "
        f"other long request in them. From the seed's own row, that is {r['ttft_mean_ms']:.0f} ms + "
        f"{r['output'] - 1} x {r['tpot_mean_ms']:.2f} ms = {per_request / 1000:.2f} s per request, "
        f"{bound:.1f} tok/s. Twice that is {tokens} tokens in {duration:.0f} s. Its {LONG_MISS_REQUESTS} prefills "
        f"({LONG_MISS_REQUESTS * r['ttft_mean_ms'] / 1000:.0f} s) cannot share a step with decodes, which leaves "
        f"{decode_s:.0f} s: at most {floor_steps:.0f} decode steps at the {BANDWIDTH_FLOOR_MS} ms "
        f"weight-streaming floor ({seed_steps:.0f} at {r['tpot_mean_ms']:.2f} ms). That needs at least "
        f"{tokens / floor_steps:.2f} sequences per decode step ({tokens / seed_steps:.2f}), so the seed's decode "
        "batches held two requests most of the time. Under the stated rules, one of the two must then be a "
        "prompt the seed counts as shorter than 4096 tokens.",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--matrix", type=Path, required=True, help="the twin's seed-static matrix JSON")
    ap.add_argument("--before-commit", required=True, help="commit holding the same JSON before the KV rule")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    stamp = Stamp("python -m bench.twin_fidelity")
    points = load_matrix(args.matrix)[1]
    rel_path = args.matrix.resolve().relative_to(ROOT)
    old = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{args.before_commit}:{rel_path}"], capture_output=True, text=True, check=True
    ).stdout
    before = matrix_points(json.loads(old))
    rows = load_profile(DEFAULT_PROFILE).section("calibration")["single_stream"]
    table, errors = single_stream(points, rows)
    changes = [rel(points[k]["output_throughput"], before[k]["output_throughput"]) for k in HELD_OUT_MISSES]
    lo, hi = 1.18 * (1 + min(changes)) - 1, 1.26 * (1 + max(changes)) - 1
    lines = [
        "# Twin fidelity (RTX 4090 + Llama-3.1-8B)",
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
        "Concurrency 4, 16 and 64: the seed's numbers are held out of the repository, so no error "
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
        *long_prompt_miss(points, rows),
    ]
    write_report(args.out, lines, stamp)


def long_prompt_miss(points: dict, rows: list) -> list[str]:
    """The (4, 4096, 256) section and the fitted constants."""
    return [
        "## The (4, 4096, 256) miss: what the numbers allow",
        "",
        "The issue says the seed ran about twice as fast as the twin here, while (4, 4096, 1024) and (4, 4096, "
        "4096) agree within 15 %. The twin at in=4096:",
        "",
        *long_prompt_points(points),
        "",
        *serial_bound(rows),
        "",
        "The seed's single-stream rows, total over output tok/s. The three in=4096 rows ran the same prompts "
        "token for token (vLLM's seeded random dataset; with range ratio 0 the length draws consume no "
        "random numbers), yet they imply different means. So the ratio also carries error in the output "
        "count and does not measure what the seed saw:",
        "",
        *implied_lengths(rows),
        "",
        "Each candidate, with the fact that refutes it (docs/twin.md has the twin runs behind each):",
        "",
        "| candidate | refuted by |",
        "|---|---|",
        *[f"| {c} | {f} |" for c, f in LONG_MISS_CANDIDATES],
        "",
        "## Which constants are fitted, and what fixed each",
        "",
        "| profile | constant | kind | fixed by |",
        "|---|---|---|---|",
        *[f"| {p} | {c} | {k} | {f} |" for p, c, k, f in CONSTANTS],
    ]


if __name__ == "__main__":
    main()
