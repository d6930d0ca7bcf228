"""The seed's 30-point benchmark matrix, how many requests it ran at each point, and the one reader of a
`headroom bench matrix` JSON that every report comparing matrix runs uses.

Why per point: the seed ran several points with one request per client (its success column says 16/16
or 64/64). With one wave the tail is the result: at (16, 32, 1024) 12 requests fit the KV pool and 4
wait for the first 12 to finish, roughly halving throughput against a steady state. A twin run with
more requests measures a different benchmark than the one it is compared with.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

Point = tuple[int, int, int]  # (concurrency, input tokens, output tokens)
MATRIX_DIR = Path(__file__).resolve().parents[1] / "bench/results/matrix"

# calibration README: con {1,4} x in {32,256,4096} x out {256,1024,4096} + con {16,64} x in {32,256} x
# out {256,1024,4096}.
SEED_MATRIX: list[Point] = [(c, i, o) for c in (1, 4) for i in (32, 256, 4096) for o in (256, 1024, 4096)] + [
    (c, i, o) for c in (16, 64) for i in (32, 256) for o in (256, 1024, 4096)
]

# The seed's success column: 20 at con 1, 40 at con 4; at con 16 and 64 one request per client except
# at the two steady-state points with 256-token prompts and outputs up to 1024.
SEED_REQUESTS_BY_CONCURRENCY = {1: 20, 4: 40, 16: 16, 64: 64}
SEED_REQUESTS_AT: dict[Point, int] = {
    (16, 256, 256): 80,
    (16, 256, 1024): 80,
    (64, 256, 256): 128,
    (64, 256, 1024): 128,
}


def num_requests(point: Point) -> int:
    """Requests the seed ran at `point`; for points it did not run, vllm bench serve's habit of a few
    requests per client (at least 20, twice the concurrency)."""
    if point in SEED_REQUESTS_AT:
        return SEED_REQUESTS_AT[point]
    if point in SEED_MATRIX:
        return SEED_REQUESTS_BY_CONCURRENCY[point[0]]
    return max(20, 2 * point[0])


def point_of(p: dict) -> Point:
    """The point a result (a matrix JSON's entry, or a run's metrics) was measured at."""
    return p["concurrency"], p["input_len"], p["output_len"]


def matrix_points(doc: dict) -> dict[Point, dict]:
    """A matrix document's results by point, in the order they were run."""
    return {point_of(p): p for p in doc["points"]}


def load_matrix(path: Path) -> tuple[dict, dict[Point, dict]]:
    """A `headroom bench matrix` JSON: the document (its command, sensors, block size) and its results by point."""
    doc = json.loads(path.read_text())
    return doc, matrix_points(doc)


def geomean(xs: Iterable[float]) -> float:
    """The geometric mean of per-point ratios: every point weighs the same, whatever its throughput."""
    logs = [math.log(x) for x in xs]
    return math.exp(sum(logs) / len(logs))
