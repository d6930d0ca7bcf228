"""The fleet report: one table per fleet size and load from `headroom bench fleet` JSONs, each router's median
and worst seed, the verdict against Ray's default router near capacity, and a plot per fleet size.

Runs of one size and load are merged (a router added later, or more seeds, is one more JSON), except that held-out
seeds (from `HELD_OUT`) get their own table: no rule was chosen by looking at them.

    python -m bench.fleet.report bench/results/fleet/*.json --out bench/results/fleet.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.fleet.command import PER_SEED, RESEND_PER_SEED, RESEND_TOTALS, TOTALS
from bench.harness.report import Stamp, write_report

TARGET = 1.3  # the TTFT p99 ratio, default / headroom, at the median seed
CANDIDATE = "headroom"
HELD_OUT = 100  # seeds from here on were not run while a rule was chosen (`headroom bench fleet --first-seed 100`)
SAME_RUN = ("capacity_req_per_s_per_replica", "scenario", "faults", "max_resends")  # what merged runs must share


def _seeds(seeds: list[int]) -> str:
    """`0-9`, `0, 5-9`: runs of consecutive seeds."""
    spans: list[list[int]] = []
    for s in sorted(seeds):
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def merge(docs: list[dict]) -> list[dict]:
    """One doc per fleet size, load and seed family (held out or not), its routers each with the seeds it ran."""
    groups: dict[tuple, dict] = {}
    for doc in docs:
        key = (doc["replicas"], doc["load"], doc["seeds"][0] >= HELD_OUT)
        group = groups.setdefault(key, {**doc, "routers": {}, "commands": [], "wall_s": 0.0})
        if any(group.get(k) != doc.get(k) for k in SAME_RUN):
            raise ValueError(f"{doc['command']}: not the load and faults of {group['commands'][0]}")
        renamed = f" (a router renamed since: {doc['renamed']}, the same rule)" if "renamed" in doc else ""
        group["commands"].append(f"`{doc['command']}`{renamed}")
        group["wall_s"] = round(group["wall_s"] + doc["wall_s"], 1)
        for name, runs in doc["routers"].items():
            per_seed = [k for k in (*PER_SEED, *RESEND_PER_SEED, "wall_s") if k in runs]
            entry = group["routers"].setdefault(name, {"seeds": [], **{k: [] for k in per_seed}})
            if set(entry["seeds"]) & set(doc["seeds"]):
                raise ValueError(f"{name} ran seeds {doc['seeds']} twice at {key}")
            entry["seeds"] += doc["seeds"]
            for k in per_seed:
                entry[k] += runs[k]
            for k in (k for k in (*TOTALS, *RESEND_TOTALS) if k in runs):
                entry[k] = entry.get(k, 0) + runs[k]
    for group in groups.values():
        for entry in group["routers"].values():  # in seed order, whichever run a seed came from
            order = sorted(range(len(entry["seeds"])), key=entry["seeds"].__getitem__)
            for k in ("seeds", *PER_SEED, *RESEND_PER_SEED, "wall_s"):
                if k in entry:
                    entry[k] = [entry[k][i] for i in order]
        group["seeds"] = sorted({s for r in group["routers"].values() for s in r["seeds"]})
    return list(groups.values())


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
    """Whether the candidate meets the issue's bar against `default` over the same seeds, and the numbers that
    say so."""
    d, h = routers["default"], routers[CANDIDATE]
    if d.get("seeds") != h.get("seeds"):
        return False, f"not judged: default ran seeds {_seeds(d['seeds'])}, {CANDIDATE} {_seeds(h['seeds'])}"
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
        if d["seeds"] != h["seeds"]:
            continue  # the table below says so
        ok, _ = verdict(r)
        bar = ("met" if ok else "missed") if doc["load"] == "near" else "-"
        med, worst, _ = ratios(r)
        p50 = f"{statistics.median(d['ttft_p50_ms']):.0f} / {statistics.median(h['ttft_p50_ms']):.0f}"
        lines.append(
            f"| {doc['replicas']} | {doc['load']} | {_seeds(d['seeds'])} | {p50} | {_mw(d['ttft_p99_ms'])} / "
            f"{_mw(h['ttft_p99_ms'])} | {med:.2f}x ({worst:.2f}x) | {bar} |"
        )
    return lines


def table(doc: dict) -> list[str]:
    lines = [
        f"### {doc['replicas']} replicas, load {doc['load']} ({doc['scenario']['rate_per_replica']} req/s per "
        f"replica; capacity {doc['capacity_req_per_s_per_replica']}), seeds {_seeds(doc['seeds'])}, wall "
        f"{doc['wall_s']} s (summed over its commands)",
        "",
        "| router | seeds | TTFT p50 ms | TTFT p99 ms | chat p99 ms | long p99 ms | output tok/s | preemptions "
        "| OOMs | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in doc["routers"].items():
        tok = statistics.median(r["out_tok_per_s"])
        lines.append(
            f"| {name} | {_seeds(r['seeds'])} | {_mw(r['ttft_p50_ms'])} | {_mw(r['ttft_p99_ms'])} | "
            f"{_mw(r['chat_ttft_p99_ms'])} | {_mw(r['long_ttft_p99_ms'])} | {tok:.0f} | {r['preemptions']} | "
            f"{r['ooms']} | {r['failed']} |"
        )
    lines += resend_table(doc)
    if {"default", CANDIDATE} <= set(doc["routers"]):
        ok, text = verdict(doc["routers"])
        judged = f"{'Meets' if ok else 'Misses'} the bar" if doc["load"] == "near" else "Above capacity (not judged)"
        lines += ["", f"{judged}: {text}."]
    return [*lines, "", *doc["commands"], ""]


def resend_table(doc: dict) -> list[str]:
    """What the ingress's re-sends did (runs with `--max-resends` above 0): totals over the seeds, and the TTFT p99
    of the requests a replica died under, from their arrival to the first token their client got."""
    if "max_resends" not in doc:
        return []
    lines = [
        "",
        f"Re-sends (at most {doc['max_resends']} a request), totals over the seeds:",
        "",
        "| router | lost | re-sent (nothing had reached the client) | resumed streams | prefill tokens re-sent "
        "| TTFT p99 ms of those requests |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in doc["routers"].items():
        lines.append(
            f"| {name} | {r['lost']} | {r['resent']} | {r['resumed']} | {r['resend_prefill_tokens']:,} | "
            f"{_mw(r['resent_ttft_p99_ms'])} |"
        )
    return lines


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
    docs = merge([json.loads(Path(p).read_text()) for p in args.inputs])
    docs.sort(key=lambda d: (d["replicas"], d["load"] != "near", d["seeds"][0]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# The fleet in virtual time: routers at 4 to 1,000 twin replicas (twin numbers)",
        "",
        "Each cell: the median over seeds, the worst seed in brackets. The bar (issue #29), near capacity: TTFT p99 "
        f"default/{CANDIDATE} at least {TARGET}x at the median seed and at least 1.0x at the worst, TTFT p50 no "
        "worse. The load, the faults, the routers, and what the runs found: docs/scale-out.md.",
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
