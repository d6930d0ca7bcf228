"""The device check: what the torch backend does on a lent GPU, beside what the twin
predicts for the same shapes. `python -m bench.device_check` (bench/device_check.sh runs it after the
CUDA-marked tests); `--device cpu --tiny` is the smoke mode the default suite runs.

It builds a random-weight Llama of Llama-3.1-8B's shape (the twin profile's [model] section; no download),
bf16, with the attention kernel `auto` picks, and measures through the real engine step:
- TPOT: the median decode-only step at batch 1, 16 and 64 (CUDA graphs, and eager beside them);
- the allocator peak of one 4096-token prefill step above what was allocated before it;
- one KV pool resize, grow and shrink.
The twin models an RTX 4090 running the seed engine; the lent GPU is an H200. Both are printed side by side
and nothing fails on the difference: the point is to see how far the twin's model is from a real card.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.backends.torch_backend import TorchBackend
from engine.backends.twin.backend import TwinBackend
from engine.backends.twin.latency import LatencyModel
from engine.backends.twin.memory import MemoryModel, StepMemory
from engine.backends.twin.profile import load_profile
from engine.baselines.seed import FixedPolicy
from engine.core.kv_cache import ResizePlan
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.model.llama import ModelConfig
from engine.model.loaders.random_model import random_llama

RESULTS = Path("bench/results/device_check")
# Llama-3.1's rope (HF config.json of meta-llama/Llama-3.1-8B): not in the twin profile, which models memory
# and time, not numerics.
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip
TINY = ModelConfig(512, 64, 128, 2, 4, 2, 16, max_position_embeddings=4096)


@dataclass(frozen=True)
class Plan:
    """The shapes measured: one set for the GPU, a tiny one for the smoke run."""

    batches: tuple[int, ...]
    prompt_len: int
    decode_steps: int  # measured decode steps per batch size
    warmup_steps: int  # decode steps run first (graph capture, allocator warm-up), not measured
    prefill_len: int
    num_blocks: int
    resize_blocks: int  # grown by this many, then shrunk back


GPU_PLAN = Plan((1, 16, 64), 128, 32, 4, 4096, 256, 64)
TINY_PLAN = Plan((1, 4), 16, 4, 1, 256, 64, 8)


@dataclass
class Report:
    device: str
    model: str
    dtype: str
    attention: str
    block_size: int
    graphs: bool
    versions: dict[str, str]
    tpot_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # batch -> {graphs, eager, twin}
    prefill: dict[str, Any] = field(default_factory=dict)
    resize: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def llama31_8b_config() -> ModelConfig:
    m = load_profile().section("model")
    return ModelConfig(
        vocab_size=int(m["vocab"]),
        hidden_size=int(m["hidden"]),
        intermediate_size=int(m["intermediate"]),
        num_layers=int(m["layers"]),
        num_heads=int(m["heads"]),
        num_kv_heads=int(m["kv_heads"]),
        head_dim=int(m["head_dim"]),
        rope_theta=500000.0,
        rope_scaling=dict(LLAMA31_ROPE),
        max_position_embeddings=int(m["max_model_len"]),
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def new_engine(backend: TorchBackend) -> LLMEngine:
    """Every request admitted and prefilled whole, decodes batched together, no KV held back."""
    return LLMEngine(backend, FixedPolicy(max_num_seqs=1024, kv_reserve_ratio=0.0))


def add_requests(engine: LLMEngine, count: int, prompt_len: int, max_tokens: int) -> None:
    vocab = engine.backend.config.vocab_size
    for i in range(count):
        prompt = [(7 + 31 * (i * prompt_len + j)) % vocab for j in range(prompt_len)]
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def decode_step_times(backend: TorchBackend, batch: int, plan: Plan) -> list[float]:
    """Seconds of each decode-only step of `batch` sequences after the warm-up steps."""
    engine = new_engine(backend)
    add_requests(engine, batch, plan.prompt_len, plan.warmup_steps + plan.decode_steps + 1)
    decoding: list[bool] = []  # per step that ran a batch: was it decode-only at full batch?
    engine.step_listeners.append(
        lambda record, b: decoding.append(record.shape.decode_seqs == batch and not record.shape.prefill_tokens)
    )
    decode = []
    while engine.has_unfinished():
        ran = len(decoding)
        t0 = time.perf_counter()
        engine.step()  # returns after the sampled ids reached the host: the device has finished
        if len(decoding) > ran and decoding[-1]:
            decode.append(time.perf_counter() - t0)
    return decode[plan.warmup_steps :]


def measure_tpot(backend: TorchBackend, plan: Plan, twin: LatencyModel) -> dict[int, dict[str, float]]:
    graphs = backend.graphs
    out: dict[int, dict[str, float]] = {}
    for batch in plan.batches:
        row: dict[str, float] = {}
        for name, runner in (("graphs", graphs), ("eager", None)):
            if name == "graphs" and graphs is None:
                continue
            backend.graphs = runner
            row[name] = statistics.median(decode_step_times(backend, batch, plan)) * 1e3
        context = plan.prompt_len + plan.warmup_steps + plan.decode_steps // 2  # mean KV tokens while measured
        row["twin_4090"] = twin.decode_step_time(batch, batch * context, batch, batch) * 1e3
        out[batch] = row
    backend.graphs = graphs
    return out


def measure_prefill(backend: TorchBackend, plan: Plan) -> dict[str, Any]:
    """One step prefilling one `prefill_len`-token prompt: the allocator peak above what was allocated before
    it (CUDA), its time, and the twin's peak for the same step."""
    engine = new_engine(backend)
    add_requests(engine, 1, plan.prefill_len, 1)
    device = backend.device
    cuda = device.type == "cuda"
    synchronize(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) - before if cuda else None
    profile = load_profile()
    logits_rows = plan.prefill_len if profile.section("engine")["logits_all_prompt_tokens"] else 1
    memory = MemoryModel(profile, int(profile.section("engine")["default_num_blocks"]), 256)
    twin = memory.run_step(StepMemory(logits_rows=logits_rows, sampled=1, prefill_seqs=1))
    return {
        "tokens": plan.prefill_len,
        "seconds": seconds,
        "peak_above_before_mib": None if peak is None else peak / 2**20,
        "twin_4090_peak_mib": twin.peak_allocated / 2**20,
        "twin_4090_logits_rows": logits_rows,
    }


def measure_resize(backend: TorchBackend, plan: Plan) -> dict[str, Any]:
    """Grow the pool by `resize_blocks` and shrink it back, each timed to the device's end; and the twin's
    modelled cost of the same resize on its 4090 pool (its default pool as the base)."""
    engine = new_engine(backend)
    base = backend.num_blocks
    result: dict[str, Any] = {"blocks": plan.resize_blocks, "block_mib": backend.block_bytes / 2**20}
    for name, target in (("grow", base + plan.resize_blocks), ("shrink", base)):
        synchronize(backend.device)
        t0 = time.perf_counter()
        engine.resize_kv_pool(target)
        synchronize(backend.device)
        result[f"{name}_ms"] = (time.perf_counter() - t0) * 1e3
    twin = TwinBackend()
    twin_base = twin.num_blocks
    grow = twin.resize_kv(ResizePlan(twin_base + plan.resize_blocks, twin_base))
    shrink = twin.resize_kv(ResizePlan(twin_base, twin_base + plan.resize_blocks))
    result.update(twin_4090_grow_ms=grow * 1e3, twin_4090_shrink_ms=shrink * 1e3, twin_4090_base_blocks=twin_base)
    result["num_blocks_after"] = backend.num_blocks
    return result


def versions() -> dict[str, str]:
    found = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import flash_attn

        found["flash_attn"] = flash_attn.__version__
    except ImportError:
        found["flash_attn"] = "not installed"
    return found


def run(device: str, tiny: bool) -> Report:
    dev = torch.device(device)
    plan = TINY_PLAN if tiny else GPU_PLAN
    dtype = torch.float32 if tiny and dev.type == "cpu" else torch.bfloat16
    cfg = TINY if tiny else llama31_8b_config()
    name = "tiny random Llama" if tiny else "random Llama-3.1-8B shape"
    backend = TorchBackend(
        random_llama(cfg, dtype, dev, name=name), dtype=dtype, device=dev, num_blocks=plan.num_blocks
    )
    report = Report(
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        model=name,
        dtype=str(dtype).removeprefix("torch."),
        attention=f"{backend.attention} ({backend.kernel_reason})",
        block_size=backend.block_size,
        graphs=backend.graphs is not None,
        versions=versions(),
    )
    report.notes.append(
        "twin_4090 columns: the twin's model of an RTX 4090 running the seed engine (its latency tables and "
        "allocator replay), not of this device; printed beside the measurement, not compared against it."
    )
    twin = LatencyModel(load_profile())
    report.tpot_ms = measure_tpot(backend, plan, twin)
    report.prefill = measure_prefill(backend, plan)
    report.resize = measure_resize(backend, plan)
    return report


def markdown(report: Report) -> str:
    lines = [
        f"# Device check: {report.device}",
        "",
        f"{report.model}, {report.dtype}, attention {report.attention}, block size {report.block_size}, "
        f"CUDA graphs {'on' if report.graphs else 'off'}; " + ", ".join(f"{k} {v}" for k, v in report.versions.items()),
        "",
        "| batch | TPOT graphs (ms) | TPOT eager (ms) | twin 4090 (ms) |",
        "|---|---|---|---|",
    ]
    for batch, row in report.tpot_ms.items():
        cells = [_ms(row.get("graphs")), _ms(row.get("eager")), _ms(row["twin_4090"])]
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    p, r = report.prefill, report.resize
    lines += [
        "",
        f"Prefill of {p['tokens']} tokens: {p['seconds'] * 1e3:.1f} ms, allocator peak above before "
        f"{_mib(p['peak_above_before_mib'])}; twin 4090 {_mib(p['twin_4090_peak_mib'])} (the seed engine it "
        f"models computes logits for {p['twin_4090_logits_rows']} rows; this engine for the sampled row only).",
        f"KV resize by {r['blocks']} blocks of {r['block_mib']:.3g} MiB: grow {r['grow_ms']:.1f} ms, shrink "
        f"{r['shrink_ms']:.1f} ms; twin 4090 (from {r['twin_4090_base_blocks']} blocks) grow "
        f"{r['twin_4090_grow_ms']:.1f} ms, shrink {r['twin_4090_shrink_ms']:.1f} ms.",
        "",
        *(f"Note: {n}" for n in report.notes),
    ]
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _mib(value: float | None) -> str:
    return "n/a (no allocator stats on this device)" if value is None else f"{value:.0f} MiB"


def write(report: Report, out: Path, say: Callable[[str], None] = print) -> None:
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(report)
    (out / "device_check.md").write_text(text)
    (out / "device_check.json").write_text(json.dumps(asdict(report), indent=2))
    say(text)
    say(f"written to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and small shapes: the smoke run")
    parser.add_argument("--out", type=Path, default=None, help="default: $OUT if set, else " + str(RESULTS))
    args = parser.parse_args()
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS)
    write(run(args.device, args.tiny), out)


if __name__ == "__main__":
    main()
