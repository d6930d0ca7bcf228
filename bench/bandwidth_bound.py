"""The memory-bandwidth bound of one decode stream (issue #46), and Headroom's batch-1 decode step against it, in
one run on this machine.

A decode step of one stream reads every weight once (as the model stores them: the default GGUF's Q4_1 layers and
its Q8_0 embedding, which a tied model reads whole as the LM head) and the stream's KV cache (as the engine stores
it: bf16 or float32, `--dtype auto`'s choice here). Over the read bandwidth of the cores the server runs on (a
STREAM-like read: each core's process sums a 256 MiB int64 array, all at once, pinned one to a core; on one core
here numpy's float32 sum reads about 15 % slower, so it would understate the bandwidth), that is the least time
a token can take. The step is measured on the engine itself (`engine.llm.LLM`, no HTTP): what the server's
forward, sampler and scheduler cost per token, in alternated rounds.

    python -m bench.bandwidth_bound --out bench/results/bandwidth_bound.md
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGUFReader

from bench.harness.machine import load_average, machine_line
from bench.harness.report import Stamp, write_report

if TYPE_CHECKING:
    from engine.llm import LLM

READ_MIB = 256  # per core: well past the last-level cache
READ_PASSES = 8


def decode_step_bytes(gguf: Path, kv_tokens: int, kv_itemsize: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step of one stream reads with `kv_tokens` in its cache. The token
    embedding is read whole only where it is also the LM head (no `output.weight`); otherwise one row of it."""
    reader = GGUFReader(gguf)
    tensors = {t.name: int(t.n_bytes) for t in reader.tensors}
    weights = sum(tensors.values()) - (tensors["token_embd.weight"] if "output.weight" in tensors else 0)
    arch = str(reader.fields["general.architecture"].contents())
    meta = {k: reader.fields[f"{arch}.{k}"].contents() for k in ("block_count", "embedding_length",
            "attention.head_count", "attention.head_count_kv")}  # fmt: skip
    head_dim = meta["embedding_length"] // meta["attention.head_count"]
    kv = 2 * meta["block_count"] * meta["attention.head_count_kv"] * head_dim * kv_tokens * kv_itemsize
    return weights, kv


def default_kv_dtype() -> torch.dtype:
    """The KV dtype `headroom serve --model default` stores on this CPU: the `auto` choices on the C++ kernel."""
    from engine.model.dtype_choice import choose_dtype, choose_kv_dtype

    model = choose_dtype("auto", torch.device("cpu")).dtype
    return choose_kv_dtype("auto", model, True, "cpu").dtype


def _read(core: int, ready: mp.Barrier, out: mp.Queue) -> None:  # type: ignore[type-arg]
    os.sched_setaffinity(0, {core})
    a = np.ones(READ_MIB * 2**20 // 8, dtype=np.int64)  # int64 adds: numpy's float32 sum is slower than the reads
    a.sum()  # pages in
    ready.wait()
    start = time.perf_counter()
    for _ in range(READ_PASSES):
        a.sum()
    out.put(a.nbytes * READ_PASSES / (time.perf_counter() - start))


def read_bandwidth(cores: list[int]) -> float:
    """Bytes per second the `cores` read together, one summing process on each."""
    ctx = mp.get_context("fork")
    ready, out = ctx.Barrier(len(cores)), ctx.Queue()
    procs = [ctx.Process(target=_read, args=(core, ready, out)) for core in cores]
    for p in procs:
        p.start()
    rates = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    return sum(rates)


def step_seconds(llm: LLM, input_len: int, output_len: int) -> float:
    """One stream's seconds per decode step: (a run of `output_len` + 1 tokens - a run of 1) / `output_len`."""
    from engine.core.sampling_params import SamplingParams

    prompt = [random.Random(0).randrange(1000, 40000) for _ in range(input_len)]

    def run(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0))
        return time.perf_counter() - start

    return (run(output_len + 1) - run(1)) / output_len


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds of the bandwidth read and the steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from engine.llm import LLM
    from engine.model.loaders import default_model_path

    stamp, load_before = Stamp("python -m bench.bandwidth_bound"), load_average()
    cores = sorted(os.sched_getaffinity(0))
    kv_dtype = default_kv_dtype()
    gguf = default_model_path()
    weights, kv = decode_step_bytes(gguf, args.input_len + args.output_len // 2, kv_dtype.itemsize)
    llm = LLM("default")
    step_seconds(llm, args.input_len, 8)  # warm-up: kernels built, pages in
    bandwidth, steps = [], []
    for _ in range(args.rounds):
        bandwidth.append(read_bandwidth(cores))
        steps.append(step_seconds(llm, args.input_len, args.output_len))
    bound = [(weights + kv) / b for b in bandwidth]
    ratios = [s / b for s, b in zip(steps, bound, strict=True)]
    data = {
        "cores": cores, "kv_dtype": str(kv_dtype), "weight_bytes": weights, "kv_bytes": kv,
        "read_gb_per_s": [round(b / 1e9, 2) for b in bandwidth], "bound_ms": [round(1e3 * b, 3) for b in bound],
        "step_ms": [round(1e3 * s, 3) for s in steps], "step_over_bound": [round(r, 2) for r in ratios],
    }  # fmt: skip
    med = statistics.median
    lines = [
        "# One decode stream against the memory-bandwidth bound (this CPU)",
        "",
        machine_line(load_before),
        "",
        f"- Bytes a decode step reads, model `default` ({gguf.name}, as stored): weights {weights / 2**20:.1f} MiB, "
        f"KV {kv / 2**20:.2f} MiB ({kv_dtype}, {args.input_len + args.output_len // 2} tokens: the middle of a "
        f"{args.input_len}-in, {args.output_len}-out request).",
        f"- Read bandwidth of cores {cores} together (numpy int64 sums of {READ_MIB} MiB, one process pinned to each): "
        f"median {med(data['read_gb_per_s']):.1f} GB/s, range {min(data['read_gb_per_s'])}-"
        f"{max(data['read_gb_per_s'])} over {args.rounds} rounds.",
        f"- Headroom's decode step, one stream, engine alone (`LLM.generate`, no HTTP; ({args.output_len}+1 tokens "
        f"less 1) / {args.output_len}), alternated with the reads: median {med(data['step_ms']):.2f} ms.",
        "",
        "| round | read GB/s | bound ms | step ms | step / bound |",
        "|---|---|---|---|---|",
        *(
            f"| {i + 1} | {g} | {b} | {s} | {r} |"
            for i, (g, b, s, r) in enumerate(
                zip(data["read_gb_per_s"], data["bound_ms"], data["step_ms"], data["step_over_bound"], strict=True)
            )
        ),  # fmt: skip
        "",
        f"Median step / bound: **{med(ratios):.2f}x** (issue #46's target for a served stream: at most 2x).",
    ]
    write_report(args.out, lines, stamp, data)


if __name__ == "__main__":
    main()
