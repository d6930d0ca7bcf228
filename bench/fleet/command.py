"""`headroom bench fleet`: every router on the same seeded loads, in virtual time (twin numbers).

The load is a multiple of one replica's capacity (`capacity`), so "near" and "above" capacity mean the same
at every fleet size. F.json holds `routers`: per router, one entry per seed of `ttft_p50_ms`, `ttft_p99_ms`
and the rest, with `ooms` and `failed` totals.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

from bench.fleet.load import Scenario, generate
from bench.fleet.routers import ROUTERS
from bench.fleet.sim import Faults, FleetSim, RunOutcome
from bench.harness.machine import machine_line
from bench.harness.report import Stamp, stamp_data, write_json
from engine.config import EngineConfig
from engine.serving.ray_serve.resend import MAX_RESENDS

LOADS = {"near": 0.9, "above": 1.15}  # of the measured capacity
CAPACITY_REQUESTS = 400  # a saturating burst: enough that its ramp and drain are small beside it
PER_SEED = ("ttft_p50_ms", "ttft_p99_ms", "chat_ttft_p99_ms", "long_ttft_p99_ms", "out_tok_per_s", "completed")
TOTALS = ("ooms", "failed", "preemptions")
# with re-sends (--max-resends above 0; the runs before them, in bench/results/fleet/, have none of these keys)
RESEND_PER_SEED = ("resent_ttft_p99_ms",)  # the requests a replica died under: what the re-sends cost them
RESEND_TOTALS = ("lost", "resent", "resumed", "resend_prefill_tokens")


def engine_config() -> EngineConfig:
    """Each replica: the 4090 twin, the adaptive controller sizing its pool, prefix caching on."""
    return EngineConfig(backend="twin", policy="adaptive", enable_prefix_caching=True)


def capacity(scenario: Scenario) -> float:
    """Requests per second one replica completes when the scenario's mix (with its shift) arrives at once:
    `CAPACITY_REQUESTS` of them within a second, no burst, no faults."""
    burst = dataclasses.replace(scenario, duration_s=1.0, rate_per_replica=CAPACITY_REQUESTS, burst=(0.0, 0.0, 1.0))
    out = FleetSim(engine_config(), 1, "default", burst, None, seed=0).run(generate(burst, 1, seed=0))
    return len(out.finished) / out.duration


def summarize(out: RunOutcome) -> dict[str, float]:
    def p(kind: str | None, q: float, resent: bool = False) -> float:
        ttft = [f.ttft for f in out.finished if (kind is None or f.kind == kind) and (f.resent or not resent)]
        return round(1000 * float(np.percentile(ttft, q)), 1) if ttft else float("nan")

    start_to_end = max((f.done_at for f in out.finished), default=0.0) or 1.0
    return {
        "ttft_p50_ms": p(None, 50),
        "ttft_p99_ms": p(None, 99),
        "chat_ttft_p99_ms": p("chat", 99),
        "long_ttft_p99_ms": p("long", 99),
        "out_tok_per_s": round(sum(f.output_tokens for f in out.finished) / start_to_end, 1),
        "completed": len(out.finished),
        "ooms": out.ooms,
        "failed": sum(out.failed.values()),
        "preemptions": out.preemptions,
        "resent_ttft_p99_ms": p(None, 99, resent=True),
        "lost": out.failed.get("replica_died", 0),
        "resent": out.resends.resent,
        "resumed": out.resends.resumed,
        "resend_prefill_tokens": out.resends.prefill_tokens,
    }


def run_one(
    replicas: int, scenario: Scenario, faults: Faults | None, max_resends: int, job: tuple[str, int]
) -> dict[str, float]:
    router, seed = job
    t = time.perf_counter()
    sim = FleetSim(engine_config(), replicas, router, scenario, faults, seed, max_resends)
    out = sim.run(generate(scenario, replicas, seed))
    return {**summarize(out), "wall_s": round(time.perf_counter() - t, 1)}


def fleet_doc(args: argparse.Namespace) -> dict[str, object]:
    base = Scenario(duration_s=args.duration)
    cap = capacity(base)
    factor = LOADS.get(args.load) or float(args.load)
    scenario = dataclasses.replace(base, rate_per_replica=round(factor * cap, 3))
    faults = None if args.no_faults else Faults()
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    jobs = [(r, s) for r in args.routers for s in seeds]
    run = partial(run_one, args.replicas, scenario, faults, args.max_resends)
    per_seed, totals = PER_SEED, TOTALS
    if args.max_resends:
        per_seed, totals = (*PER_SEED, *RESEND_PER_SEED), (*TOTALS, *RESEND_TOTALS)
    t = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(run, jobs))
    else:
        results = [run(j) for j in jobs]
    routers: dict[str, dict[str, object]] = {}
    for (router, _), res in zip(jobs, results, strict=True):
        entry = routers.setdefault(router, {k: [] for k in (*per_seed, "wall_s")} | dict.fromkeys(totals, 0))
        for k in (*per_seed, "wall_s"):
            entry[k].append(res[k])  # type: ignore[union-attr]
        for k in totals:
            entry[k] += res[k]  # type: ignore[operator]
    return {
        "replicas": args.replicas, "seeds": seeds, "load": args.load,
        "capacity_req_per_s_per_replica": round(cap, 3), "scenario": dataclasses.asdict(scenario),
        "faults": dataclasses.asdict(faults) if faults else None, "wall_s": round(time.perf_counter() - t, 1),
        "machine": machine_line(), "routers": routers,
    } | ({"max_resends": args.max_resends} if args.max_resends else {})  # fmt: skip


def _fleet(args: argparse.Namespace) -> int:
    stamp = Stamp("headroom")
    doc = stamp_data(fleet_doc(args), stamp)
    for name, r in doc["routers"].items():  # type: ignore[union-attr]
        resends = f"  resent {r['resent']}  resumed {r['resumed']}  lost {r['lost']}" if "resent" in r else ""
        print(f"{name:18s} p50 {np.median(r['ttft_p50_ms']):8.1f} ms  p99 {np.median(r['ttft_p99_ms']):8.1f} ms  "
              f"(median over seeds)  failed {r['failed']}  ooms {r['ooms']}{resends}")  # fmt: skip
    if args.out:
        write_json(Path(args.out), doc)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _load(text: str) -> str:
    if text in LOADS:
        return text
    try:
        if float(text) > 0:
            return text
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"--load is near, above or a positive multiple of capacity; got {text!r}")


def _routers(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in ROUTERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown router {unknown}; known: {', '.join(ROUTERS)}")
    return names


def register(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser("fleet", help="every router over N twin replicas on seeded loads, in virtual time")
    f.add_argument("--replicas", type=int, required=True)
    f.add_argument("--seeds", type=int, default=10, help="K seeds, each a different load and fault draw")
    f.add_argument("--first-seed", type=int, default=0, help="seeds first..first+K-1 (held-out checks: 100)")
    f.add_argument("--load", type=_load, default="near", help="near (0.9x capacity), above (1.15x) or a multiple")
    f.add_argument("--duration", type=float, default=Scenario.duration_s, help="seconds of arrivals")
    f.add_argument("--routers", type=_routers, default=list(ROUTERS), help=f"comma-separated: {','.join(ROUTERS)}")
    f.add_argument("--no-faults", action="store_true", help="no replica dies or loses memory")
    f.add_argument(
        "--max-resends", type=int, default=MAX_RESENDS,
        help="as the fleet's ingress: a request whose replica died is sent to another this often (0: lost)",
    )  # fmt: skip
    f.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")
    f.add_argument("--out", default=None, help="write the JSON here")
    f.set_defaults(func=_fleet)
