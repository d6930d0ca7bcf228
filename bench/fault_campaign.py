"""A fault campaign on the twin: the adaptive engine (sized KV pool) with realistic sensors, on the seed matrix
and a ShareGPT-like trace, while another process takes and frees memory, the allocator's cache is fragmented
and steps fail with injected OOMs (bench/fault_run.py: the faults, when they strike, what is counted), the
NVML read period drawn per load from 0 to 500 ms (0: a fresh read at every step).

Why a second run of each load with ideal sensors: it meets the same faults at the same virtual times, so
the ratio of output throughputs isolates what the sensors cost (with realistic sensors the twin also models
the CUDA graph pool, captured at start-up and kept over every resize: engine/backends/twin/sensors.py).
`throughput_vs_ideal` is the lowest ratio over the loads; `lost`, `unrecovered_ooms` and `pool_below_held`
are the realistic runs' totals, the ideal runs' beside them.

    python -m bench.fault_campaign --out bench/results/fault_campaign.json
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bench.fault_run import MAX_EXTERNAL, RATES, Fault, FaultRun, Rates, schedule
from bench.harness.report import Stamp, write_report
from bench.loadgen import TraceRequest, load_trace, run_closed_loop, run_trace
from bench.seed_matrix import SEED_MATRIX, Point, num_requests
from engine.backends.twin.backend import as_twin
from engine.cli import engine_config
from engine.core.llm_engine import LLMEngine
from engine.factory import build_engine
from telemetry.units import GIB

TRACE = Path("bench/results/sharegpt_like_300.jsonl")
MAX_NVML_LAG_S = 0.5
TARGETS = {"lost": 0, "unrecovered_ooms": 0, "pool_below_held": 0}  # at most
MIN_THROUGHPUT_VS_IDEAL = 0.9


@dataclass(frozen=True)
class Load:
    """A seed matrix point (closed loop) or a trace (open loop at its recorded times)."""

    name: str
    point: Point | None = None
    num_requests: int = 0
    trace: tuple[TraceRequest, ...] = ()

    @property
    def requests(self) -> int:
        return self.num_requests if self.point is not None else len(self.trace)

    def drive(self, engine: LLMEngine) -> None:
        """Every step through the engine (no fast path): the faults land between steps."""
        if self.point is None:
            run_trace(engine, self.trace, fast=False)
        else:
            run_closed_loop(engine, self.point[0], self.num_requests, *self.point[1:], fast=False)


def seed_loads(requests: int | None = None) -> list[Load]:
    """The seed matrix, each point with the seed's request count (or `requests`)."""
    return [Load("x".join(map(str, p)), p, requests or num_requests(p)) for p in SEED_MATRIX]


def trace_load(path: Path = TRACE, limit: int | None = None) -> Load:
    return Load(path.stem, trace=tuple(load_trace(path)[:limit]))


def drive(engine: LLMEngine, load: Load, faults: Iterator[Fault]) -> tuple[dict[str, Any], list[Fault]]:
    """Run `load` on `engine` under `faults`: the run's counters and the faults applied, in order."""
    run = FaultRun(engine, faults)
    error = None
    try:
        load.drive(engine)
    except Exception as e:  # an engine that did not go on is a result to count, not a campaign to stop
        error = f"{type(e).__name__}: {e}"
    return run.counters(load.requests, error), run.applied


def twin_engine(sensors: str, nvml_period: float | None = None) -> LLMEngine:
    """The adaptive engine with its sized pool, `sensors` named explicitly (the default may change); the
    realistic sensor's NVML read period set to `nvml_period` after start-up."""
    engine = build_engine(engine_config(["--backend", "twin", "--policy", "adaptive", "--twin-sensors", sensors]))
    if nvml_period is not None:
        as_twin(engine.backend).nvml.period = nvml_period
    return engine


def run_load(load: Load, seed: int = 0, rates: Rates = RATES) -> dict[str, Any]:
    """Both runs of one load, realistic and ideal, under the same faults."""
    key = f"{seed}/{load.name}"
    lag = random.Random(f"{key}/nvml").uniform(0, MAX_NVML_LAG_S)
    real, real_faults = drive(twin_engine("realistic", lag), load, schedule(key, rates))
    ideal, ideal_faults = drive(twin_engine("ideal"), load, schedule(key, rates))
    n = min(len(real_faults), len(ideal_faults))
    ratio = real["output_throughput"] / ideal["output_throughput"] if ideal["output_throughput"] else 0.0
    return {
        "load": load.name,
        "requests": load.requests,
        "nvml_period_s": lag,
        "same_schedule": real_faults[:n] == ideal_faults[:n],
        "throughput_vs_ideal": ratio,
        "realistic": real,
        "ideal": ideal,
    }


def targets_met(doc: dict[str, Any]) -> dict[str, bool]:
    met = {k: doc[k] <= v for k, v in TARGETS.items()}
    return met | {"throughput_vs_ideal": doc["throughput_vs_ideal"] >= MIN_THROUGHPUT_VS_IDEAL}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The top-level fields (the realistic runs'; the ideal runs' beside them) and every load's row."""

    def total(side: str, key: str) -> int:
        return sum(r[side][key] for r in rows)

    worst = min(rows, key=lambda r: r["throughput_vs_ideal"])
    doc: dict[str, Any] = {"requests": sum(r["requests"] for r in rows)}
    doc.update({k: total("realistic", k) for k in (*TARGETS, "rejected", "ooms", "ooms_injected", "ooms_recovered")})
    doc.update(throughput_vs_ideal=worst["throughput_vs_ideal"], worst_load=worst["load"])
    doc["same_schedule"] = all(r["same_schedule"] for r in rows)
    doc["met"] = all(targets_met(doc).values())
    doc["ideal"] = {k: total("ideal", k) for k in (*TARGETS, "rejected")}
    doc["loads"] = rows
    return doc


def campaign(loads: list[Load], seed: int = 0, rates: Rates = RATES, jobs: int = 1) -> dict[str, Any]:
    run = partial(run_load, seed=seed, rates=rates)
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            rows = list(pool.map(run, loads))
    else:
        rows = [run(load) for load in loads]
    return {"seed": seed, "rates": asdict(rates), **summarize(rows)}


def _row(r: dict[str, Any]) -> str:
    real, ideal, f = r["realistic"], r["ideal"], r["realistic"]["faults"]
    cells = [
        r["load"],
        f"{real['completed']}/{r['requests']} ({real['rejected']})",
        f"{r['nvml_period_s'] * 1e3:.0f}",
        "/".join(str(f.get(k, 0)) for k in ("external", "fragment", "oom")),
        f"{real['ooms']} ({real['ooms_injected']}) / {real['ooms_recovered']}",
        real["unrecovered_ooms"],
        real["pool_below_held"],
        f"{real['pool_blocks'][0]}-{real['pool_blocks'][1]}",
        f"{real['output_throughput']:.1f}",
        f"{ideal['output_throughput']:.1f}",
        f"{r['throughput_vs_ideal']:.3f}",
        f"{ideal['completed']}/{r['requests']} ({ideal['rejected']})",
        f"{ideal['ooms']} ({ideal['ooms_injected']})",
        real["error"] or ideal["error"] or "",
    ]
    return "| " + " | ".join(map(str, cells)) + " |"


def report(doc: dict[str, Any], wall_s: float) -> list[str]:
    met = targets_met(doc)
    targets = {**{k: f"<= {v}" for k, v in TARGETS.items()}, "throughput_vs_ideal": f">= {MIN_THROUGHPUT_VS_IDEAL}"}
    r = doc["rates"]
    return [
        "# Fault campaign on the twin: realistic sensors against ideal, under the same faults",
        "",
        f"Adaptive engine, sized KV pool; {len(doc['loads'])} loads (the seed matrix and a ShareGPT-like trace), "
        f"{doc['requests']} requests; seed {doc['seed']}. Each fault a Poisson process in virtual time: another "
        f"process asks for nothing or up to {MAX_EXTERNAL // GIB} GiB every {r['external_s']:g} s on average, "
        f"fragmentation every {r['fragment_s']:g} s, an injected OOM every {r['oom_s']:g} s; the NVML read period "
        f"drawn per load from 0 to {MAX_NVML_LAG_S * 1e3:.0f} ms. bench/fault_run.py says how each is counted.",
        "",
        "| field | result | target | met |",
        "|---|---|---|---|",
        *(f"| {k} | {doc[k]:.4g} | {targets[k]} | {'yes' if met[k] else 'NO'} |" for k in targets),
        "",
        f"Lowest throughput ratio at {doc['worst_load']}. Requests refused at admission (counted as lost): "
        f"{doc['rejected']}. OOMs {doc['ooms']} ({doc['ooms_injected']} injected), recovered {doc['ooms_recovered']}. "
        f"Both runs of every load met the same faults: {doc['same_schedule']}. Ideal runs: "
        + ", ".join(f"{k} {v}" for k, v in doc["ideal"].items())
        + ".",
        "",
        f"Wall time {wall_s:.0f} s.",
        "",
        "Per load: ok = completed/requests (refused at admission); faults met by the realistic run, "
        "external/fragmentation/OOM; OOMs = all (injected) / recovered.",
        "",
        "| load | ok | NVML ms | faults | OOMs | unrecovered | pool<held | pool blocks | tok/s | ideal tok/s "
        "| vs ideal | ideal ok | ideal OOMs | error |",
        "|" + "---|" * 14,
        *(_row(row) for row in doc["loads"]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="the JSON; the markdown report goes beside it (.md)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=None, help="per seed point (default: the seed's count)")
    ap.add_argument("--jobs", type=int, default=1, help="loads run in parallel processes")
    for kind, default in asdict(RATES).items():
        ap.add_argument(f"--{kind.replace('_', '-')}", type=float, default=default, help="mean seconds between faults")
    a = ap.parse_args()
    stamp = Stamp("python -m bench.fault_campaign")
    t = time.perf_counter()
    rates = Rates(a.external_s, a.fragment_s, a.oom_s)
    doc = campaign([*seed_loads(a.requests), trace_load()], a.seed, rates, a.jobs)
    doc["wall_s"] = round(time.perf_counter() - t, 1)
    write_report(a.out.with_suffix(".md") if a.out else None, report(doc, doc["wall_s"]), stamp, doc)


if __name__ == "__main__":
    main()
