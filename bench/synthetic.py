"""A synthetic ShareGPT-like request trace in vLLM's per-request JSONL format, for replays on the twin.

Why synthetic: the real vLLM trace the twin is judged on is held out of the repository on purpose, so
tests and committed results use a trace of the same shape instead: ShareGPT-like (long-tailed,
log-normal) prompt and output lengths with the held-out run's means and caps, Poisson arrivals at a fixed
rate (what `vllm bench serve --request-rate` sends), and absolute epoch arrival times as vLLM writes
them. Seeded, so the committed trace and results can be rebuilt exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EPOCH = 1_767_225_600.0  # 2026-01-01T00:00:00Z: where the trace's clock starts


@dataclass(frozen=True)
class LengthShape:
    """A log-normal length distribution clipped to [low, high], its location solved for `mean`."""

    mean: float
    low: int
    high: int
    sigma: float

    def sample(self, z: np.ndarray) -> np.ndarray:
        """Lengths for standard-normal draws `z`, with the clipped mean within half a token of `mean`."""
        lo, hi = -10.0, 20.0
        for _ in range(100):  # bisection on the log-scale location: the clipped mean rises with it
            mu = (lo + hi) / 2
            lengths = np.clip(np.rint(np.exp(mu + self.sigma * z)), self.low, self.high)
            if lengths.mean() < self.mean:
                lo = mu
            else:
                hi = mu
        return lengths.astype(int)


# ShareGPT-like shapes of the held-out run: prompts mean ~850 tokens up to 4000, outputs mean ~650 up to 1024.
SHAREGPT_INPUT = LengthShape(mean=850, low=4, high=4000, sigma=1.0)
SHAREGPT_OUTPUT = LengthShape(mean=650, low=1, high=1024, sigma=0.9)


def sharegpt_like_trace(
    num_requests: int = 300,
    request_rate: float = 10.0,
    seed: int = 0,
    inputs: LengthShape = SHAREGPT_INPUT,
    outputs: LengthShape = SHAREGPT_OUTPUT,
) -> list[dict[str, object]]:
    """`num_requests` records (request_id, input_toks, output_toks, arrival_time in epoch seconds) with
    exponential gaps at `request_rate` per second, the first at EPOCH."""
    rng = np.random.default_rng(seed)
    ins = inputs.sample(rng.standard_normal(num_requests))
    outs = outputs.sample(rng.standard_normal(num_requests))
    gaps = rng.exponential(1.0 / request_rate, num_requests)
    gaps[0] = 0.0
    arrivals = EPOCH + np.cumsum(gaps)
    return [
        {
            "request_id": f"synthetic-{i}",
            "input_toks": int(ins[i]),
            "output_toks": int(outs[i]),
            "arrival_time": round(float(arrivals[i]), 6),
        }
        for i in range(num_requests)
    ]


def write_trace(path: str | Path, records: list[dict[str, object]]) -> None:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))
