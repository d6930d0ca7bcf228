"""The controller's acceptance matrix on the 4090 twin: adaptive against seed-static at 64, 80 and 96 KV
blocks, with throughput, TTFT and end-to-end latency side by side (all twin numbers, virtual time).

Runs `headroom bench matrix` six times into --dir (skip with --no-run to rebuild the report from the
JSONs already there) and writes the report:

    python -m bench.controller_acceptance --dir bench/results/matrix \
        --out bench/results/controller_acceptance.md
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from bench.harness.report import Stamp, write_report
from bench.seed_matrix import Point, geomean, load_matrix

BLOCKS = (64, 80, 96)
POLICIES = ("adaptive", "seed-static")


def matrix_cmd(policy: str, blocks: int, out: Path) -> list[str]:
    return [
        "headroom",
        "bench",
        "matrix",
        "--backend",
        "twin",
        "--twin-sensors",
        "ideal",  # against the seed's rules as calibrated: exact sensors, as the facts were taken
        "--policy",
        policy,
        "--num-blocks",
        str(blocks),
        "--jobs",
        "2",
        "--out",
        str(out),
    ]


def point_table(ad: dict[Point, dict], sd: dict[Point, dict]) -> list[str]:
    lines = [
        "| con | in | out | adaptive tok/s | seed tok/s | ratio | adaptive TTFT mean / p99 ms "
        "| seed TTFT mean / p99 ms | adaptive E2EL mean / p99 s | seed E2EL mean / p99 s "
        "| adaptive failed / OOMs | seed failed / OOMs | adaptive preemptions |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, a in ad.items():
        s = sd[k]
        ratio = f"{a['output_throughput'] / s['output_throughput']:.3f}" if s["output_throughput"] else "seed failed"
        lines.append(
            f"| {k[0]} | {k[1]} | {k[2]} | {a['output_throughput']:.1f} | {s['output_throughput']:.1f} | {ratio} | "
            f"{a['mean_ttft_ms']:.0f} / {a['p99_ttft_ms']:.0f} | {s['mean_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} | "
            f"{a['mean_e2el_ms'] / 1e3:.1f} / {a['p99_e2el_ms'] / 1e3:.1f} | "
            f"{s['mean_e2el_ms'] / 1e3:.1f} / {s['p99_e2el_ms'] / 1e3:.1f} | "
            f"{a['failed']} / {a['ooms']} | {s['failed']} / {s['ooms']} | {a['preemptions']} |"
        )
    return lines


def targets(runs: dict[tuple[str, int], dict[Point, dict]]) -> list[str]:
    ad, sd = runs["adaptive", 64], runs["seed-static", 64]
    ratio = {k: ad[k]["output_throughput"] / sd[k]["output_throughput"] for k in ad}
    rows = []

    def row(name: str, result: str, holds: bool) -> None:
        rows.append(f"| {name} | {result} | {'yes' if holds else 'NO'} |")

    failed = sum(p["failed"] for p in ad.values())
    ooms = sum(p["ooms"] for p in ad.values())
    row("64 blocks: all 30 points, 0 failed and 0 OOMs", f"failed {failed}, OOMs {ooms}", not failed and not ooms)
    low = min(ratio, key=ratio.get)
    row(">= 0.98x seed-static at every point", f"min {ratio[low]:.3f} at {low}", ratio[low] >= 0.98)
    for k in ((16, 256, 1024), (64, 32, 1024), (64, 256, 256)):
        row(f">= 1.3x at {k}", f"{ratio[k]:.3f}", ratio[k] >= 1.3)
    g = geomean([ratio[k] for k in ad if k[2] == 4096 and k[0] >= 4])
    row("geomean over out=4096, con>=4: >= 1.5x", f"{g:.3f}", g >= 1.5)
    for b in BLOCKS[1:]:
        a, s = runs["adaptive", b], runs["seed-static", b]
        seed_oom = [k for k in s if s[k]["ooms"]]
        bad = [k for k in a if a[k]["ooms"] or a[k]["failed"]]
        row(
            f"{b} blocks: 0 OOMs with adaptive where seed-static OOMs ({len(seed_oom)} points)",
            f"adaptive OOMs or failures at {len(bad)} points",
            not bad,
        )
        long = {k: a[k]["output_throughput"] / ad[k]["output_throughput"] for k in a if k[2] == 4096}
        kv_bound = [x for k, x in long.items() if k[0] >= 4]
        row(
            f"{b} blocks: long-output throughput above adaptive at 64 blocks",
            "per point "
            + ", ".join(f"{k[0]}/{k[1]}: {x:.3f}" for k, x in long.items())
            + f"; geomean con>=4 {geomean(kv_bound):.3f} (con 1 is not KV-bound)",
            min(kv_bound) > 1.0 and min(long.values()) >= 0.995,
        )
    return ["| target | result | holds |", "|---|---|---|", *rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the matrix JSONs go")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-run", action="store_true", help="only rebuild the report from --dir")
    args = ap.parse_args()
    stamp = Stamp("python -m bench.controller_acceptance")
    args.dir.mkdir(parents=True, exist_ok=True)
    paths = {(p, b): args.dir / f"{p}_{b}.json" for p in POLICIES for b in BLOCKS}
    if not args.no_run:
        for (p, b), path in paths.items():
            subprocess.run(matrix_cmd(p, b, path), check=True, stdout=subprocess.DEVNULL)
    loaded = {k: load_matrix(path) for k, path in paths.items()}
    runs = {k: v[1] for k, v in loaded.items()}
    lines = [
        "# Adaptive controller on the 4090 twin: acceptance matrix",
        "",
        "Twin numbers, virtual time; adaptive runs its default config (controller/default.toml) at every point.",
        "",
        *[f"- `{doc['command']}`" for doc, _ in loaded.values()],
        "",
        "## Acceptance targets",
        "",
        *targets(runs),
    ]
    for b in BLOCKS:
        lines += ["", f"## {b} KV blocks", "", *point_table(runs["adaptive", b], runs["seed-static", b])]
    write_report(args.out, lines, stamp)


if __name__ == "__main__":
    main()
