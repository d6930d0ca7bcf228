"""Per-step cost of telemetry (CPU probe sampled/unsampled, Metrics.observe_step, StepTrace.append)
against a CPU decode step, to check the <= 2% budget.

    .venv/bin/python bench/bench_telemetry.py [--steps 30] [--sample-every 8 16 32]

The decode step is a real SmolLM2 step (engine.backends.torch_backend.TorchBackend("default"), batch 8) when
that module exists, otherwise a toy forward with SmolLM2-135M's shapes (random weights, 30 layers,
hidden 576, GQA 9/3 heads, fused qkv and gate/up, KV cache written in place and gathered per step):
the same op count and matmul sizes, which is what the tracker's cost and the step time depend on.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from telemetry.metrics import Metrics
from telemetry.probes.cpu import CpuProbe
from telemetry.probes.null import NullProbe
from telemetry.record import MemorySample, StepRecord, StepShape
from telemetry.trace import StepTrace

BATCH, CONTEXT = 8, 512


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- toy SmolLM2-135M decode step -------------------------------------------------------------------


class ToyDecoder:
    """SmolLM2-135M shapes; one decode step for BATCH sequences at CONTEXT tokens."""

    def __init__(self, dtype: torch.dtype, layers: int = 30, hidden: int = 576, heads: int = 9, kv_heads: int = 3):
        self.dtype, self.layers, self.hidden, self.heads, self.kv_heads = dtype, layers, hidden, heads, kv_heads
        self.hd, inter, vocab = hidden // heads, 1536, 49152
        g = torch.Generator().manual_seed(0)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

        qkv = (heads + 2 * kv_heads) * self.hd
        self.w = [
            (w(hidden), w(qkv, hidden), w(hidden, hidden), w(hidden), w(2 * inter, hidden), w(hidden, inter))
            for _ in range(layers)
        ]
        self.embed, self.norm = w(vocab, hidden), w(hidden)
        slots = BATCH * (CONTEXT + 64)
        self.k = [torch.zeros(slots, kv_heads, self.hd, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(slots, kv_heads, self.hd, dtype=dtype) for _ in range(layers)]
        self.gather = torch.arange(BATCH * CONTEXT).view(BATCH, CONTEXT)  # "block table" slots per sequence
        self.write = self.gather[:, -1].contiguous()
        inv = 1.0 / 10000 ** (torch.arange(0, self.hd, 2).float() / self.hd)
        ang = torch.full((BATCH, 1), CONTEXT - 1.0) * inv
        self.cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)[:, None, :]
        self.sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)[:, None, :]

    @staticmethod
    def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * weight

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * self.cos + rotated * self.sin

    @torch.inference_mode()
    def step(self) -> list[int]:
        x = self.embed[torch.tensor([1] * BATCH)]
        nq, nkv, hd = self.heads, self.kv_heads, self.hd
        for i, (ln1, wqkv, wo, ln2, wgu, wd) in enumerate(self.w):
            qkv = F.linear(self._rms(x, ln1), wqkv)
            q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], -1)
            q = self._rope(q.view(BATCH, nq, hd))
            k = self._rope(k.view(BATCH, nkv, hd))
            self.k[i].index_copy_(0, self.write, k)
            self.v[i].index_copy_(0, self.write, v.view(BATCH, nkv, hd))
            keys = self.k[i][self.gather].transpose(1, 2)  # [B, kv, T, hd]
            values = self.v[i][self.gather].transpose(1, 2)
            attn = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, enable_gqa=True)
            x = x + F.linear(attn.reshape(BATCH, nq * hd), wo)
            gate, up = F.linear(self._rms(x, ln2), wgu).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, wd)
        logits = F.linear(self._rms(x, self.norm), self.embed)
        return logits.argmax(-1).tolist()


def count_ops(fn: Callable[[], object]) -> int:
    probe = CpuProbe(1 << 40, sample_every=1, overhead_budget=None, measure_overhead=False)
    with probe.step(StepShape(decode_seqs=BATCH)):
        fn()
    return probe.ops_tracked


# ---- real backend (when engine/backends/torch_backend.py exists) ---------------------------------------------


def real_decode_step() -> tuple[Callable[[], object], Callable[[object], None], str] | None:
    """A closure running one real engine decode step at batch 8, and a setter for the backend's probe."""
    if importlib.util.find_spec("engine.backends.torch_backend") is None:
        return None
    from controller.baselines import FixedPolicy
    from engine.core.llm_engine import LLMEngine
    from engine.core.sampling_params import SamplingParams

    backend = importlib.import_module("engine.backends.torch_backend").TorchBackend("default")
    engine = LLMEngine(backend, FixedPolicy())
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    for i in range(BATCH):
        engine.add_request(f"r{i}", list(range(10, 10 + 64)), params)
    engine.step()  # the prefill step(s)
    while engine.scheduler.waiting:
        engine.step()

    def set_probe(probe: object) -> None:
        backend.probe = probe

    return engine.step, set_probe, f"TorchBackend('default') on {getattr(backend, 'device', 'cpu')}"


# ---- main -------------------------------------------------------------------------------------------


def fake_record(probe_sample: MemorySample) -> StepRecord:
    return StepRecord(
        step_id=1,
        time=0.0,
        duration=0.05,
        shape=StepShape(decode_seqs=BATCH, sum_context=BATCH * CONTEXT, max_context=CONTEXT, sampled_seqs=BATCH),
        memory=probe_sample,
        kv_blocks_used=256,
        kv_blocks_free=768,
        kv_blocks_total=1024,
        num_running=BATCH,
        limits={
            "max_prefill_tokens": 2048,
            "max_prefill_seqs": 8,
            "max_decode_seqs": 1 << 30,
            "max_num_seqs": 64,
            "max_batched_tokens": 1 << 30,
            "kv_reserve_ratio": 0.0,
            "allow_mixed": True,
        },
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="timed repeats per measurement")
    ap.add_argument("--sample-every", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--toy", action="store_true", help="use the toy forward even if TorchBackend exists")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="thread: main-thread CPU time, robust to other load on a shared box (use with --threads 1)",
    )
    args = ap.parse_args()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock")

    real = None if args.toy else real_decode_step()
    shape = StepShape(decode_seqs=BATCH, max_context=CONTEXT)
    if real is not None:
        engine_step, set_probe, what = real

        def one_step(probe: object) -> float:
            set_probe(probe)
            t0 = clock()
            engine_step()
            return clock() - t0

        desc = f"real decode step: engine step of {what}, batch {BATCH}, 64-token prompts"
    else:
        candidates = {}
        for dtype in (torch.float32, torch.bfloat16):
            toy = ToyDecoder(dtype)
            candidates[dtype] = (median_time(toy.step, 3, warmup=1), toy)
            print(f"toy decode step {dtype}: {candidates[dtype][0] * 1e3:.1f} ms")
        # The faster dtype makes the overhead ratio larger: the conservative choice.
        dtype = min(candidates, key=lambda d: candidates[d][0])
        toy = candidates[dtype][1]

        def one_step(probe: object) -> float:
            t0 = clock()
            with probe.step(shape):  # type: ignore[attr-defined]
                toy.step()
            return clock() - t0

        desc = (
            f"toy SmolLM2-135M-shaped decode step ({dtype}, batch {BATCH}, context {CONTEXT}); "
            "engine/backends/torch_backend.py not present"
        )

    # Round robin (null, sampled, unsampled), rotating the order each round, so load drift on a shared
    # machine hits all three alike; the sampled cost is the median of per-round paired differences.
    null_probe = NullProbe()
    sampled_probe = CpuProbe(1 << 40, sample_every=1, overhead_budget=None)
    unsampled_probe = CpuProbe(1 << 40, sample_every=0)
    default_probe = CpuProbe(1 << 40)  # the defaults a server runs with
    probes = [null_probe, sampled_probe, unsampled_probe, default_probe]
    times: list[list[float]] = [[], [], [], []]
    for r in range(args.steps + 2):
        for k in range(4):
            i = (r + k) % 4
            t = one_step(probes[i])
            if r >= 2:  # warm-up rounds
                times[i].append(t)
    base, sampled, unsampled, default = (statistics.median(t) for t in times)
    sampled_extra = max(0.0, statistics.median(s - b for s, b in zip(times[1], times[0], strict=True)))
    # The sampled-every-step probe has no unsampled steps to compare with: its self-report is the
    # in-hook lower bound. Wall time; with --clock thread comparable only on an idle box.
    self_reported = sampled_probe.overhead_seconds / sampled_probe.sampled_steps
    ops = sampled_probe.ops_tracked // max(1, sampled_probe.sampled_steps)

    # Pure costs of the cheap parts, timed in isolation (a step-time difference would be noise).
    bare = CpuProbe(1 << 40, sample_every=0, measure_overhead=False)
    with bare.step(shape):
        pass
    n = 20000
    t0 = clock()
    for _ in range(n):
        with bare.step(shape):
            pass
    unsampled_cost = (clock() - t0) / n
    metrics = Metrics("bench")
    record = fake_record(MemorySample(peak_allocated=3 << 20, idle_baseline=1 << 20, capacity=1 << 30))
    t0 = clock()
    for _ in range(n):
        metrics.observe_step(record)
    metrics_cost = (clock() - t0) / n
    ring = StepTrace(1024)
    t0 = clock()
    for _ in range(n):
        ring.append(record)
    ring_cost = (clock() - t0) / n
    with tempfile.TemporaryDirectory() as tmp, StepTrace(1024, Path(tmp) / "t.jsonl") as filed:
        t0 = clock()
        for _ in range(n):
            filed.append(record)
        file_cost = (clock() - t0) / n

    print(f"\n{desc}")
    print(f"decode step (NullProbe)             {base * 1e3:9.2f} ms")
    print(
        f"decode step, sampled CpuProbe       {sampled * 1e3:9.2f} ms  (+{sampled_extra * 1e3:.2f} ms, "
        f"{sampled_extra / base:.1%}; {ops} ops, {sampled_extra / max(ops, 1) * 1e6:.1f} us/op)"
    )
    print(
        f"  probe's in-hook estimate          {self_reported * 1e3:9.2f} ms  (dispatch round trip "
        f"{sampled_probe.dispatch_cost * 1e6:.1f} us/op calibrated + bookkeeping "
        f"{sampled_probe.bookkeeping_seconds / max(1, sampled_probe.ops_tracked) * 1e6:.1f} us/op measured)"
    )
    print(f"decode step, unsampled CpuProbe     {unsampled * 1e3:9.2f} ms")
    print(
        f"decode step, default CpuProbe       {default * 1e3:9.2f} ms  (sample_every="
        f"{default_probe.sample_every}, overhead_budget={default_probe.overhead_budget}: "
        f"{default_probe.sampled_steps}/{default_probe.steps} steps sampled, self-reported overhead "
        f"{default_probe.overhead_seconds / default_probe.step_seconds:.2%} of its step time, "
        f"{default_probe.overhead_seconds / max(1, default_probe.sampled_steps) * 1e3:.1f} ms per sampled step)"
    )
    print(f"decode step spread (NullProbe)      {min(times[0]) * 1e3:.1f} .. {max(times[0]) * 1e3:.1f} ms")
    print(f"unsampled probe bracket alone       {unsampled_cost * 1e6:9.2f} us")
    print(f"Metrics.observe_step                {metrics_cost * 1e6:9.2f} us")
    print(f"StepTrace.append (ring only)        {ring_cost * 1e6:9.2f} us")
    print(f"StepTrace.append (ring + JSONL)     {file_cost * 1e6:9.2f} us")
    fixed = unsampled_cost + metrics_cost + file_cost
    print("\namortized per step (probe + metrics + trace with file), % of the decode step:")
    print("  (sampled cost from the paired step difference | from the probe's in-hook lower bound)")
    for every in args.sample_every:
        for label, extra in (("measured", sampled_extra), ("in-hook", self_reported)):
            per_step = extra / every + fixed
            verdict = "ok" if per_step / base <= 0.02 else "OVER 2%"
            print(f"  sample_every={every:<3d} {label:14s} {per_step * 1e6:9.1f} us {per_step / base:6.2%}  {verdict}")
    print(
        "  with the default overhead_budget=0.005 the probe also skips periodic samples while its own"
        " (self-reported) cost exceeds 0.5% of step time, whatever sample_every is"
    )


if __name__ == "__main__":
    main()
