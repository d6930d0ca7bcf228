"""`headroom bench matrix|replay|reproduce|fleet`: benchmark an engine (the twin by default) in virtual time.

matrix: the seed's 30-point matrix (or --points), closed loop like `vllm bench serve --max-concurrency`.
replay: a JSONL trace (input_toks, output_toks, arrival_time), open loop at the recorded times.
Both print a markdown table and write {"points": [...]} (plus the command and engine settings) to --out.
reproduce: re-run the committed results (bench/reproduce.py).
fleet: every router over N twin replicas on seeded loads (bench/fleet/).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

from bench import reproduce
from bench.fleet import command as fleet
from bench.harness.report import Stamp, stamp_data, stamped, write_json
from bench.loadgen import RunResult, load_trace, run_closed_loop, run_trace
from bench.report import latency_table, markdown_table, metrics
from bench.seed_matrix import SEED_MATRIX, num_requests
from engine.cli import add_config_flags, config_from_args
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.factory import build_backend, build_engine, sizes_kv_pool


def parse_points(text: str) -> list[tuple[int, int, int]]:
    """ "con,in,out;con,in,out" -> [(con, in, out), ...]."""
    points = []
    for part in text.replace(" ", "").split(";"):
        if part:
            c, i, o = (int(x) for x in part.split(","))
            points.append((c, i, o))
    if not points:
        raise argparse.ArgumentTypeError("no points given")
    return points


def run_point(
    cfg: EngineConfig, point: tuple[int, int, int], num_prompts: int | None = None, fast: bool = True
) -> dict[str, object]:
    """One closed-loop point on a fresh engine (fresh KV pool, allocator and policy state)."""
    con, inp, out = point
    engine = build_engine(cfg)
    n = num_prompts or num_requests(point)
    t = time.perf_counter()
    run = run_closed_loop(engine, con, n, inp, out, fast=fast)
    m = _metrics(engine, run, policy=cfg.policy, concurrency=con, input_len=inp, output_len=out, num_prompts=n)
    m["wall_s"] = round(time.perf_counter() - t, 3)
    return m


def _metrics(engine: LLMEngine, run: RunResult, **labels: object) -> dict[str, object]:
    """A run's metrics and the largest KV pool it ran with (a controller-sized pool moves)."""
    m = metrics(run, **labels)
    m["kv_pool_peak_blocks"] = engine.allocator.peak_blocks
    return m


def _settings(cfg: EngineConfig) -> dict[str, object]:
    settings: dict[str, object] = {
        "backend": cfg.backend,
        "policy": cfg.policy,
        "num_blocks": cfg.num_blocks,
        "block_size": cfg.block_size,
    }
    if cfg.backend == "twin":  # cheap to build: resolve the defaults exactly as the runs do
        b = build_backend(cfg)
        settings.update(profile=cfg.profile, model=b.model_name, num_blocks=b.num_blocks, block_size=b.block_size)
        settings["twin_sensors"] = cfg.twin_sensors
    if sizes_kv_pool(cfg):
        settings["num_blocks"] = "sized by the controller (each point's kv_pool_peak_blocks)"
    return settings


def write_run(out: str | Path | None, doc: dict[str, object], stamp: Stamp, details: str = "") -> None:
    """Print a run's table; with `out`, write its JSON there and the table beside it (.md), both stamped."""
    table = markdown_table(doc["points"])  # type: ignore[arg-type]
    if details:
        table += "\n\n" + details
    print(table)
    if out:
        path = Path(out)
        write_json(path, stamp_data(doc, stamp))
        md = path.with_suffix(".md")
        sensors = [f"twin sensors: {doc['twin_sensors']}", ""] if "twin_sensors" in doc else []
        md.write_text("\n".join(stamped([*sensors, f"wall time {doc['wall_s']} s", "", table], stamp)) + "\n")
        print(f"wrote {path} and {md}", file=sys.stderr)


def replay_doc(cfg: EngineConfig, trace: str | Path, fast: bool = True) -> dict[str, object]:
    """One open-loop replay of a JSONL trace on a fresh engine: the settings, the wall time and the point."""
    reqs = load_trace(trace)
    t = time.perf_counter()
    doc = _settings(cfg)
    engine = build_engine(cfg)
    run = run_trace(engine, reqs, fast=fast)
    point = _metrics(engine, run, policy=cfg.policy, trace=str(trace), num_prompts=len(reqs))
    doc["wall_s"] = round(time.perf_counter() - t, 2)
    doc["points"] = [point]
    return doc


def _matrix(cfg: EngineConfig, args: argparse.Namespace) -> int:
    points = args.points or SEED_MATRIX
    t = time.perf_counter()
    doc = _settings(cfg)
    run = partial(run_point, cfg, num_prompts=args.num_prompts, fast=not args.no_fast_path)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(run, points))
    else:
        results = [run(p) for p in points]
    doc["wall_s"] = round(time.perf_counter() - t, 2)
    doc["points"] = results
    write_run(args.out, doc, Stamp("headroom"))
    return 0


def _replay(cfg: EngineConfig, args: argparse.Namespace) -> int:
    doc = replay_doc(cfg, args.trace, fast=not args.no_fast_path)
    write_run(args.out, doc, Stamp("headroom"), latency_table(doc["points"][0]))  # type: ignore[index]
    return 0


def _run(p: argparse.ArgumentParser, command: Callable[..., int], args: argparse.Namespace) -> int:
    return command(config_from_args(p, EngineConfig, args), args)


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmark an engine in virtual time (twin) or wall time")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    reproduce.register(sub)
    fleet.register(sub)
    m = sub.add_parser("matrix", help="closed-loop matrix, like vllm bench serve --max-concurrency")
    m.add_argument("--points", type=parse_points, default=None, help='"con,in,out;..." (default: seed matrix)')
    m.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per point (default: the seed's count there, bench/seed_matrix.py)",
    )
    m.add_argument("--jobs", type=int, default=1, help="points run in parallel processes")
    r = sub.add_parser("replay", help="open-loop replay of a JSONL trace")
    r.add_argument(
        "--trace", required=True, help="vLLM per-request JSONL: request_id, input_toks, output_toks, arrival_time"
    )
    for p, command in ((m, _matrix), (r, _replay)):
        add_config_flags(p, EngineConfig, backend="twin", policy="seed-static")
        p.set_defaults(func=partial(_run, p, command))
        p.add_argument("--out", default=None, help="write the points as JSON here (and a .md beside it)")
        p.add_argument(
            "--no-fast-path",
            action="store_true",
            help="step the engine one step at a time even through identical decode steps",
        )
