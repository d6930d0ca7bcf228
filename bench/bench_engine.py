"""Engine-core throughput straight on TorchBackend (no scheduler): prefill tok/s for one long prompt, and
decode output tok/s for a batch of sequences that each hold `--context` tokens of KV.

Decode sequences start with their context marked as already computed (the KV holds zeros): attention
cost depends on the context length, not on what the cache holds, and it saves prefilling 32 x 300 tokens
on a small CPU. The batches are plain data built here (ScheduledItem, each request's blocks a range of the
pool): no engine, scheduler or allocator runs.

Besides wall-clock tok/s it reports tokens per CPU-second of this process: on a machine shared with other
busy processes, wall time mostly measures the neighbours, while with --threads 1 CPU time still measures
the engine (with more threads it also counts OpenMP's spin-waiting).

    python -m bench.bench_engine --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from bench.harness.machine import load_average, machine_line
from engine.backends.torch_backend import TorchBackend
from engine.core.batch import ScheduledItem, SchedulerOutput
from engine.core.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=None)


def random_ids(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def item(rid: str, prompt: tuple[int, ...], token_ids: list[int], start: int, table: list[int]) -> ScheduledItem:
    """The step of one request that computes `token_ids` at `start` and samples the token after them."""
    n = len(token_ids)
    return ScheduledItem(rid, token_ids, start, n, n > 1, True, table, GREEDY, prompt, start + n + 1)


def timed(backend: TorchBackend, batch: SchedulerOutput) -> tuple[list[int], float, float]:
    """execute(batch): (tokens, wall seconds, CPU seconds of this process)."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = backend.execute(batch).sampled
    return tokens, time.perf_counter() - wall, time.process_time() - cpu


def bench_prefill(backend: TorchBackend, tokens: int, repeats: int, rng: random.Random) -> tuple[float, float]:
    """Best of `repeats` single-prompt prefills (one step, one sampled token): (tok/s, tok/CPU-s)."""
    table = list(range(-(-tokens // backend.block_size)))
    times = []
    for _ in range(repeats):
        prompt = random_ids(tokens, backend.config.vocab_size, rng)
        batch = SchedulerOutput()
        batch.add(item("p", tuple(prompt), prompt, 0, table))
        times.append(timed(backend, batch)[1:])
    return tokens / min(t[0] for t in times), tokens / min(t[1] for t in times)


def bench_decode(
    backend: TorchBackend, batch_size: int, context: int, steps: int, rng: random.Random
) -> tuple[float, float]:
    """Output (tok/s, tok/CPU-s) over the median of `steps` decode steps of `batch_size` sequences, after
    one warm-up step."""
    per_seq = -(-(context + steps + 2) // backend.block_size)
    if batch_size * per_seq > backend.num_blocks:
        raise MemoryError(f"KV cache: {batch_size} x {per_seq} blocks asked for, {backend.num_blocks} in the pool")
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch_size)]
    prompts = [tuple(random_ids(context, backend.config.vocab_size, rng)) for _ in range(batch_size)]
    last = [rng.randrange(100, backend.config.vocab_size) for _ in range(batch_size)]  # each one's first output
    durations = []
    for step in range(steps + 1):
        batch = SchedulerOutput()
        for i in range(batch_size):
            batch.add(item(str(i), prompts[i], [last[i]], context + step, tables[i]))
        last, wall, cpu = timed(backend, batch)
        durations.append((wall, cpu))
    wall, cpu = zip(*durations[1:], strict=True)
    return batch_size / statistics.median(wall), batch_size / statistics.median(cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--prefill-tokens", type=int, default=1024)
    p.add_argument("--prefill-repeats", type=int, default=2)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--attention", default="auto", help="attention kernel (engine/model/kernel_choice.py)")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per batch size")
    p.add_argument("--quantization", default="auto", help="engine/model/quant.py: auto, none, q8_0, q4_0, q4_1")
    p.add_argument(
        "--layers", choices=["auto", "python"], default="auto", help="python: the Python loop even where the "
        "layers could run as one C++ call (engine/model/cpu_forward.py)",
    )  # fmt: skip
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    block_size = 16
    per_seq = -(-(args.context + args.steps + 2) // block_size)
    num_blocks = max(max(batches) * per_seq, -(-args.prefill_tokens // block_size)) + 8
    backend = TorchBackend(
        args.model, args.dtype, "cpu", args.quantization, num_blocks=num_blocks, attention=args.attention
    )
    if args.layers == "python":
        backend.model.fused = None
    rng = random.Random(0)
    bench_prefill(backend, 128, 1, rng)  # warm-up
    load_before = load_average()
    print(f"model {backend.model_name}, dtype {args.dtype}, threads {args.threads}, {backend.quant_reason}")
    forced = " (layers forced to the Python loop)" if args.layers == "python" else ""
    print(f"kernels: {backend.kernel_reason}{forced}")
    print("| measurement | tok/s | tok/CPU-s |\n|---|---|---|")
    if args.prefill_tokens:
        wall, cpu = bench_prefill(backend, args.prefill_tokens, args.prefill_repeats, rng)
        print(f"| prefill, {args.prefill_tokens}-token prompt | {wall:.1f} | {cpu:.1f} |", flush=True)
    for b in batches:
        wall, cpu = bench_decode(backend, b, args.context, args.steps, rng)
        print(f"| decode, batch {b}, context {args.context} | {wall:.1f} | {cpu:.1f} |", flush=True)
    print(machine_line(load_before))


if __name__ == "__main__":
    main()
