"""The first performance figures against the card's physical limits, both measured in the same call: decode steps
against the bytes they must read over the copy bandwidth, and a long prefill against the FLOPs it must do over the
matmul rate.

Why these bounds: a decode step reads every weight once (the embedding table aside: a step gathers a row a
sequence) and each sequence's cached K and V, and does too little arithmetic per byte to be bound by anything
but memory at these batch sizes; a prefill of thousands of tokens does about 2 x parameters FLOPs a token (plus
causal attention), far above the card's FLOP/byte ratio, so the matmul rate bounds it. Each bound is the least
time any implementation could take on this card, so measured / bound is how far Headroom's step is from it (1.0:
at the limit). The ceilings are measured, not the datasheet's: a device-to-device copy counting bytes read and
written, and a large bf16 matrix product on random data, each the median of several timed runs after warm-ups.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from bench.device_checks.common import GIB, Load, Result, Session, fixed_engine, mean_ms, run, twin
from engine.model.model_config import ModelConfig

TIMED_RUNS = 10
WARM_UPS = 3


def timed(s: Session, fn: Callable[[], object], runs: int = TIMED_RUNS) -> float:
    """The median seconds of `fn` over `runs` runs after WARM_UPS, synchronized on the device."""
    for _ in range(WARM_UPS):
        fn()
    seconds = []
    for _ in range(runs):
        s.synchronize()
        t0 = time.perf_counter()
        fn()
        s.synchronize()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def copy_bandwidth(s: Session) -> float:
    """Bytes a second of a device-to-device copy of `copy_bytes`, counting what it reads and what it writes."""
    n = s.plan.copy_bytes
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=s.device)
    dst = torch.empty_like(src)
    return 2 * n / timed(s, lambda: dst.copy_(src))


def matmul_rate(s: Session) -> float:
    """FLOP/s of a square product of `matmul_size` in the session's dtype, on random data (zeros run faster)."""
    n = s.plan.matmul_size
    a, b = (torch.randn(n, n, dtype=s.dtype, device=s.device) for _ in range(2))
    return 2 * n**3 / timed(s, lambda: torch.matmul(a, b))


def weight_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """The bytes a decode step reads of the weights: every linear, the LM head included, once."""
    attention = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * cfg.hidden_size
    attention += cfg.num_heads * cfg.head_dim * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return itemsize * (cfg.num_layers * (attention + mlp) + cfg.vocab_size * cfg.hidden_size)


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """2 x (linear weights but the LM head) a token, and causal attention: QK^T and PV over the keys each token
    sees (the LM head runs on the last token only)."""
    linear = weight_bytes(cfg, 1) - cfg.vocab_size * cfg.hidden_size
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2
    return 2 * linear * tokens + attention


def roofline(s: Session) -> Result:
    r = Result(
        "roofline",
        "Decode and prefill against the card's limits",
        "figures only, no pass mark: each step's time over the least time the card allows it (decode: the weights' "
        "and the KV's bytes over the copy bandwidth; prefill: its FLOPs over the matmul rate), both ceilings "
        "measured in this call; the step runs to its end with the tokens it was asked for",
    )
    bandwidth, rate = copy_bandwidth(s), matmul_rate(s)
    cfg, item = s.config, s.dtype.itemsize
    r.figure(f"copy bandwidth, {s.plan.copy_bytes / GIB:.3g} GiB read + written (GB/s)", bandwidth / 1e9, None)
    r.figure(f"matmul rate, {s.plan.matmul_size}^3 {str(s.dtype).removeprefix('torch.')} (TFLOP/s)", rate / 1e12, None)
    r.figure("weights a decode step reads (GB)", weight_bytes(cfg, item) / 1e9, None)
    backend = s.shared()
    ok = True
    for batch in s.plan.decode_batches:
        load = Load(batch, s.plan.decode_context, s.plan.decode_tokens)
        work = [(load.prompt, load.tokens)] * batch
        log = run(fixed_engine(backend), work)
        full = [t for t, n in zip(log.decode_seconds, log.decode_batches, strict=True) if n == batch]
        predicted = run(fixed_engine(twin()), work)
        twin_full = [t for t, n in zip(predicted.decode_seconds, predicted.decode_batches, strict=True) if n == batch]
        context = load.prompt + load.tokens // 2
        bound = (weight_bytes(cfg, item) + batch * context * kv_bytes_per_token(cfg, item)) / bandwidth
        step = statistics.median(full) if full else None
        r.figure(f"decode, batch {batch}, context ~{context}: median step (ms)", step and step * 1e3,
                 mean_ms(twin_full))  # fmt: skip
        r.figure(f"decode, batch {batch}: bound, bytes / bandwidth (ms)", bound * 1e3, None)
        r.figure(f"decode, batch {batch}: measured / bound", step and step / bound, None)
        ok = ok and not log.lost and bool(full)
    tokens = s.plan.prefill_tokens
    seconds, lost = [], 0
    for i in range(s.plan.prefill_runs):  # different prompts: no prefix cache hit
        log = run(fixed_engine(backend, prefill_chunk=tokens), [(tokens, 1)], first_index=1000 + i)
        seconds += log.prefill_seconds
        lost += log.lost
    predicted = run(fixed_engine(twin(), prefill_chunk=tokens), [(tokens, 1)])
    bound = prefill_flops(cfg, tokens) / rate
    step = statistics.median(seconds) if seconds else None
    r.figure(
        f"prefill of {tokens} tokens, one step: median (ms)", step and step * 1e3, mean_ms(predicted.prefill_seconds)
    )
    r.figure(f"prefill of {tokens} tokens: bound, FLOPs / matmul rate (ms)", bound * 1e3, None)
    r.figure(f"prefill of {tokens} tokens: measured / bound", step and step / bound, None)
    r.notes.append(
        f"attention {backend.attention} ({backend.kernel_reason}); decode steps replayed CUDA graphs: "
        f"{backend.graphs is not None and not backend.graphs.disabled}"
    )
    r.passed = ok and not lost and len(seconds) == s.plan.prefill_runs
    return r
