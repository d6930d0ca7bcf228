"""The fleet report: one table per fleet size and load from `headroom bench fleet` JSONs, each router's median
and worst seed, the verdict against Ray's default router near capacity, and a plot per fleet size.

    python -m bench.fleet.report bench/results/fleet/*.json --out bench/results/fleet.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.harness.report import Stamp, write_report

TARGET = 1.3  # the TTFT p99 ratio, default / headroom, at the median seed
CANDIDATE = "headroom"


def _seeds(doc: dict) -> str:
    seeds = doc["seeds"]
    return f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else str(seeds[0])


def _mw(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({max(values):.0f})"


def ratios(routers: dict[str, dict]) -> tuple[float, float, bool]:
    """TTFT p99 default/candidate at the median seed and at the worst, and whether the candidate's p50 is no
    worse."""
    d, h = routers["default"], routers[CANDIDATE]
    med = statistics.median(d["ttft_p99_ms"]) / statistics.median(h["ttft_p99_ms"])
    worst = max(d["ttft_p99_ms"]) / max(h["ttft_p99_ms"])
    return med, worst, statistics.median(h["ttft_p50_ms"]) <= statistics.median(d["ttft_p50_ms"])


def verdict(routers: dict[str, dict]) -> tuple[bool, str]:
    """Whether the candidate meets the issue's bar against `default`, and the numbers that say so."""
    d, h = routers["default"], routers[CANDIDATE]
    med, worst, p50 = ratios(routers)
    ok = med >= TARGET and worst >= 1.0 and p50
    return ok, (
        f"TTFT p99 default/{CANDIDATE}: {med:.2f}x at the median seed (target {TARGET}x), {worst:.2f}x at the "
        f"worst (target 1.0x); p50 {'no worse' if p50 else 'WORSE'} "
        f"({statistics.median(h['ttft_p50_ms']):.0f} vs {statistics.median(d['ttft_p50_ms']):.0f} ms)"
    )


def summary(docs: list[dict]) -> list[str]:
    """One row per fleet size and load: the default router against the candidate, median and worst seed."""
    lines = [
        f"| replicas | load | seeds | TTFT p50 ms, default / {CANDIDATE} | TTFT p99 ms, default / {CANDIDATE} "
        "(worst seed) | p99 ratio, median (worst) | bar |",
        "|---|---|---|---|---|---|---|",
    ]
    for doc in docs:
        r = doc["routers"]
        if not {"default", CANDIDATE} <= set(r):
            continue
        d, h = r["default"], r[CANDIDATE]
        ok, _ = verdict(r)
        bar = ("met" if ok else "missed") if doc["load"] == "near" else "-"
        med, worst, _ = ratios(r)
        p50 = f"{statistics.median(d['ttft_p50_ms']):.0f} / {statistics.median(h['ttft_p50_ms']):.0f}"
        lines.append(
            f"| {doc['replicas']} | {doc['load']} | {_seeds(doc)} | {p50} | {_mw(d['ttft_p99_ms'])} / "
            f"{_mw(h['ttft_p99_ms'])} | {med:.2f}x ({worst:.2f}x) | {bar} |"
        )
    return lines


def table(doc: dict) -> list[str]:
    lines = [
        f"### {doc['replicas']} replicas, load {doc['load']} ({doc['scenario']['rate_per_replica']} req/s per "
        f"replica; capacity {doc['capacity_req_per_s_per_replica']}), seeds {_seeds(doc)}, wall {doc['wall_s']} s",
        "",
        "| router | TTFT p50 ms | TTFT p99 ms | chat p99 ms | long p99 ms | output tok/s | preemptions | OOMs "
        "| failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in doc["routers"].items():
        tok = statistics.median(r["out_tok_per_s"])
        lines.append(
            f"| {name} | {_mw(r['ttft_p50_ms'])} | {_mw(r['ttft_p99_ms'])} | {_mw(r['chat_ttft_p99_ms'])} | "
            f"{_mw(r['long_ttft_p99_ms'])} | {tok:.0f} | {r['preemptions']} | {r['ooms']} | {r['failed']} |"
        )
    if {"default", CANDIDATE} <= set(doc["routers"]):
        ok, text = verdict(doc["routers"])
        judged = f"{'Meets' if ok else 'Misses'} the bar" if doc["load"] == "near" else "Above capacity (not judged)"
        lines += ["", f"{judged}: {text}."]
    return [*lines, "", f"`{doc['command']}`", ""]


def plot(docs: list[dict], path: Path) -> None:
    """TTFT p99 by router, every seed a point, near and above capacity side by side (needs the `plot` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(docs), figsize=(5 * len(docs), 4), squeeze=False)
    for ax, doc in zip(axes[0], docs, strict=True):
        names = list(doc["routers"])
        for x, name in enumerate(names):
            p99 = [v / 1000 for v in doc["routers"][name]["ttft_p99_ms"]]
            ax.scatter([x] * len(p99), p99, s=12, alpha=0.7)
            ax.hlines(statistics.median(p99), x - 0.3, x + 0.3, color="k")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("TTFT p99 (s), each seed; bar: median")
        ax.set_title(f"{doc['replicas']} twin replicas, load {doc['load']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="headroom bench fleet JSONs")
    ap.add_argument("--out", required=True, help="the markdown report; plots beside it")
    ap.add_argument("--no-plot", action="store_true", help="write no PNG (the markdown still links them)")
    args = ap.parse_args()
    docs = [json.loads(Path(p).read_text()) for p in args.inputs]
    docs.sort(key=lambda d: (d["replicas"], d["load"] != "near"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# The fleet in virtual time: routers at 4 to 1,000 twin replicas (twin numbers)",
        "",
        "Each cell: the median over seeds, the worst seed in brackets. The bar (issue #29), near capacity: TTFT p99 "
        f"default/{CANDIDATE} at least {TARGET}x at the median seed and at least 1.0x at the worst, TTFT p50 no "
        "worse. The load, the faults, the routers, and why the p50 misses from 64 replicas up: docs/scale-out.md.",
        "",
        *summary(docs),
        "",
    ]
    sizes = sorted({d["replicas"] for d in docs})
    for size in sizes:
        at = [d for d in docs if d["replicas"] == size]
        lines += [f"## {size} replicas", ""]
        for doc in at:
            lines += table(doc)
        png = out.with_name(f"{out.stem}_{size}.png")
        if not args.no_plot:
            plot(at, png)
        lines += [f"![TTFT p99 by router, {size} replicas]({png.name})", ""]
    lines += [docs[0]["machine"] if docs else ""]
    write_report(out, lines, Stamp("python -m bench.fleet.report"))


if __name__ == "__main__":
    main()
