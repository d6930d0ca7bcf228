"""Benchmark metrics with `vllm bench serve`'s names and definitions, and a markdown table of points.

Why the same names: results must be comparable line by line with the seed's calibration table and with
runs of real servers. Definitions (vLLM's): TTFT = first token - request sent; TPOT = (e2e - TTFT) /
(output tokens - 1) per request; ITL = every gap between consecutive tokens of a request; E2EL = last
token - request sent; throughputs count successful requests only, over the run's duration; percentiles
are numpy's (linear interpolation), reported at 90, 95 and 99 as `vllm bench serve --metric-percentiles
90,95,99` names them (p90_ttft_ms, ...).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from bench.loadgen import RunResult

MS = 1e3
PERCENTILES = (90, 95, 99)


def _stats(prefix: str, values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float) * MS
    empty = not len(a)
    out = {
        f"mean_{prefix}_ms": 0.0 if empty else float(a.mean()),
        f"median_{prefix}_ms": 0.0 if empty else float(np.median(a)),
    }
    for p in PERCENTILES:
        out[f"p{p}_{prefix}_ms"] = 0.0 if empty else float(np.percentile(a, p))
    return out


def metrics(run: RunResult, **point: object) -> dict[str, object]:
    """One benchmark point: `point` (policy, concurrency, input_len, output_len, ...) plus the metrics."""
    ok = [s for s in run.sequences if s.finish_reason in ("length", "stop")]
    ttft, tpot, itl, e2el = [], [], [], []
    for s in ok:
        t = s.token_times
        ttft.append(t[0] - s.arrival_time)
        e2el.append(t[-1] - s.arrival_time)
        if len(t) > 1:
            tpot.append((t[-1] - t[0]) / (len(t) - 1))
            itl.extend(np.diff(t).tolist())
    out_tokens = sum(len(s.output_ids) for s in ok)
    in_tokens = sum(s.prompt_len for s in ok)
    dur = run.duration
    m: dict[str, object] = dict(point)
    m.update(
        completed=len(ok),
        failed=run.num_requests - len(ok),
        ooms=run.ooms,
        duration=dur,
        steps=run.steps,
        preemptions=run.preemptions,
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        request_throughput=len(ok) / dur if dur > 0 else 0.0,
        output_throughput=out_tokens / dur if dur > 0 else 0.0,
        total_token_throughput=(in_tokens + out_tokens) / dur if dur > 0 else 0.0,
    )
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        m.update(_stats(name, values))
    return m


COLUMNS = [
    ("policy", "policy", "{}"),
    ("con", "concurrency", "{}"),
    ("in", "input_len", "{}"),
    ("out", "output_len", "{}"),
    ("ok", "completed", "{}"),
    ("failed", "failed", "{}"),
    ("OOMs", "ooms", "{}"),
    ("out tok/s", "output_throughput", "{:.2f}"),
    ("total tok/s", "total_token_throughput", "{:.2f}"),
    ("TTFT mean / p99 ms", ("mean_ttft_ms", "p99_ttft_ms"), "{:.2f} / {:.2f}"),
    ("TPOT mean / p99 ms", ("mean_tpot_ms", "p99_tpot_ms"), "{:.2f} / {:.2f}"),
    ("ITL mean / p99 ms", ("mean_itl_ms", "p99_itl_ms"), "{:.2f} / {:.2f}"),
    ("E2EL mean / p99 s", ("mean_e2el_ms", "p99_e2el_ms"), "{:.1f} / {:.1f}"),
]


def markdown_table(points: Iterable[dict[str, object]]) -> str:
    lines = ["| " + " | ".join(c[0] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for p in points:
        cells = []
        for _, key, fmt in COLUMNS:
            vals = [p.get(k, "") for k in (key if isinstance(key, tuple) else (key,))]
            if fmt.startswith("{:.1f}"):  # E2EL in seconds
                vals = [v / MS for v in vals]
            cells.append(fmt.format(*vals))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


LATENCIES = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2EL", "e2el"))


def latency_table(point: dict[str, object]) -> str:
    """One point's latency distributions as `vllm bench serve` prints them: mean, median and percentiles."""
    stats = ("mean", "median", *(f"p{p}" for p in PERCENTILES))
    lines = ["| ms | " + " | ".join(stats) + " |", "|" + "---|" * (len(stats) + 1)]
    for label, key in LATENCIES:
        lines.append(f"| {label} | " + " | ".join(f"{point[f'{s}_{key}_ms']:.2f}" for s in stats) + " |")
    return "\n".join(lines)
