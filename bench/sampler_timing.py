"""Per-step time of the sampler at one batch size on one device, for each mix of sampling parameters.

Why: issue #14 asks for a sampler that stays on the device and does not sort the whole vocabulary per
row; this measures one `Sampler.sample` call (the draw, not penalties or logprobs) on the same logits
before and after such a change. `python -m bench.sampler_timing --batch 64 --vocab 49152`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.core.sampler import Sampler
from engine.core.sampling_params import SamplingParams

MIXES: dict[str, list[SamplingParams]] = {
    "greedy": [SamplingParams(temperature=0)],
    "temperature": [SamplingParams(temperature=0.8)],
    "top_k=50": [SamplingParams(temperature=0.8, top_k=50)],
    "top_p=0.9": [SamplingParams(temperature=0.8, top_p=0.9)],
    "seeded mix": [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0.8, top_k=50, seed=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(temperature=0),
    ],
}


def time_mix(params: list[SamplingParams], batch: int, vocab: int, device: torch.device, steps: int) -> float:
    """Median seconds of one sample() call over `steps` calls on fresh random logits."""
    sampler = Sampler(seed=0)
    rows = [params[i % len(params)] for i in range(batch)]
    gen = torch.Generator(device=device).manual_seed(0)
    times = []
    for step in range(steps):
        logits = torch.randn(batch, vocab, generator=gen, device=device) * 4
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        sampler.sample(logits, rows, [step] * batch)  # returns a list: the device has finished
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"sampler, batch {args.batch}, vocab {args.vocab}, {device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads: median ms per step over {args.steps} steps")  # fmt: skip
    for name, params in MIXES.items():
        print(f"  {name:12s} {time_mix(params, args.batch, args.vocab, device, args.steps) * 1e3:8.2f}")


if __name__ == "__main__":
    main()
