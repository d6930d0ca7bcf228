"""The device check: what the torch backend does on a lent GPU, beside what the twin predicts for the same
requests. `bash bench/device_check.sh` runs it after the CUDA-marked tests; `bash bench/device_check.sh --cpu` is
the smoke run of the default suite (tests/test_device_check.py), the same script down to the first CUDA call.

The checks (bench/device_checks/), each with a criterion, its figures and the twin's beside them:
1. the KV pool in CUDA virtual memory, its blocks packed into granules, and given back when dropped;
2. token equality between eager and CUDA-graph decode (in float32: bf16's rounding differs with the batch);
3. NVML's readings beside the allocator's over a run;
4. decode and prefill times against the card's limits, measured in the same call (figures, no pass mark);
5. a KV pool grow and shrink with CUDA graphs live;
6. the fast attention kernels' logits against sdpa's: flash-attn (on the CPU the C++ kernel), and Triton's decode;
7. a real OOM, caused by a ballast tensor in a second process, recovered with no request lost;
8. the sized KV pool following a second process's allocation.
Before them, bench/device_check.sh runs the suite's CUDA-marked tests (tensor parallelism over NCCL among them: it
needs a GPU a rank, so on one card it is not run, and the same test runs over gloo on the CPU); `--cuda-tests`
hands their JUnit XML here, and each becomes a row of the report: PASS, FAIL, or NOT RUN with pytest's reason (a
skip on a GPU is not a pass).

The model is a random-weight Llama of Llama-3.1-8B's shape in bf16: nothing is downloaded. The twin models an
RTX 4090 running Llama-3.1-8B, not the lent card (an H200), so its figures are its prediction for the same requests
on its own card, to show how far its model is from a real one; only the device's figures decide a check. The
smoke run takes a tiny model on the CPU: what needs CUDA is not run there (passed None, with the reason), the rest
runs, the OOM's second process simulated. Exits 1 when a check fails or crashes; one not run is named with its
reason in the verdict. The report is written after every check, so a run cut short by its time limit still leaves
one: bench/results/device_check.md (and .json), and in $OUT too when that is set (the device tool brings back only
what is there).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from bench.device_checks.common import GIB, MIB, Load, Plan, Result, Session, Value
from bench.device_checks.cuda_tests import cuda_test_results
from bench.device_checks.memory import nvml_vs_allocator, oom_recovery, pool_follows, vmm_pool
from bench.device_checks.numerics import fast_vs_sdpa, graphs_vs_eager, kv_resize, triton_vs_sdpa
from bench.device_checks.roofline import roofline
from engine.backends.torch_backend import kernel_for
from engine.backends.twin.profile import load_profile
from engine.model.model_config import ModelConfig

RESULTS = Path("bench/results/device_check.md")
# Llama-3.1's rope (HF config.json of meta-llama/Llama-3.1-8B): not in the twin profile, which models memory
# and time, not numerics.
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip
# vocab above 1000: start-up pool sizing fills its prompts with ids up to 1000 (engine/core/kv/sizing.py)
TINY = ModelConfig(1024, 64, 128, 2, 4, 2, 16, max_position_embeddings=4096)
GPU_PLAN = Plan(
    pool_tokens=49152,  # the roofline's decode at batch 64 holds 64 x 544 tokens
    decode=Load(24, 64, 32),
    decode_pool_tokens=16384,  # 24 requests of at most 64 + 13 x 23 + 32 tokens
    logit_prompts=(1024, 700, 300, 45),
    nvml=Load(48, 256, 48),
    nvml_batch=16,
    resize_tokens=8192,
    oom=Load(4, 1024, 16),
    follow=Load(16, 512, 64),
    follow_steps=(32, 300, 32, 800),
    copy_bytes=4 * GIB,  # far above the 60 MB L2: the copy measures HBM
    matmul_size=8192,
    decode_batches=(1, 16, 64),
    decode_context=512,
    decode_tokens=32,
    prefill_tokens=4096,
    prefill_runs=3,
)
TINY_PLAN = Plan(2048, Load(6, 16, 8), 1024, (40, 17, 5), Load(16, 16, 48), 4, 256, Load(2, 64, 4), Load(4, 32, 16),
                 (8, 100, 8, 600), 64 * MIB, 256, (1, 4), 16, 8, 128, 2)  # fmt: skip
CHECKS: tuple[Callable[[Session], Result], ...] = (
    vmm_pool,
    graphs_vs_eager,
    nvml_vs_allocator,
    roofline,
    kv_resize,  # after the ones above: it leaves the shared backend's pool resized
    fast_vs_sdpa,  # frees the shared backend: a second 8B model would not fit beside it on a 24 GB card
    triton_vs_sdpa,
    oom_recovery,
    pool_follows,  # its pool takes most of the device
)
TWIN_NOTE = (
    "The twin column is the twin's prediction for the same requests: it models an RTX 4090 running Llama-3.1-8B "
    "(engine/backends/twin/, realistic sensors), not this device, so times and bytes differ by as much as the "
    "cards do, and only the measured column decides a check. It has no numerics: token and logit figures have "
    "no twin value."
)


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


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlSystemGetDriverVersion()
    except Exception as e:  # the report says why rather than failing the run
        return f"unknown ({type(e).__name__})"


def describe(s: Session, smoke: bool, argv: list[str]) -> dict[str, str]:
    kernel = kernel_for("auto", None, s.device, s.dtype)
    if s.cuda:
        device = f"{torch.cuda.get_device_name(s.device)}, {torch.cuda.mem_get_info(s.device)[1] / GIB:.1f} GiB"
        software = f"driver {driver_version()}, CUDA {torch.version.cuda}, "
    else:
        device, software = f"CPU ({platform.machine()}, {platform.processor() or 'unknown'})", ""
    packages = ("torch", "triton", "flash-attn", "cuda-bindings", "nvidia-ml-py")
    software += ", ".join(f"{p} {version(p)}" for p in packages) + f", python {platform.python_version()}"
    return {
        "device": device + (", smoke run (not a device result)" if smoke else ""),
        "setup": f"{s.model_name}, {str(s.dtype).removeprefix('torch.')}, attention by default {kernel.attention} "
        f"({kernel.reason}), block size {kernel.block_size}",
        "software": software,
        "run": f"`{' '.join(['python -m bench.device_check', *argv])}` at {time.strftime('%Y-%m-%d %H:%M')}",
    }


def verdict(r: Result) -> str:
    if r.passed is None:
        return f"NOT RUN ({r.skipped})"
    return "PASS" if r.passed else "FAIL"


def overall(results: list[Result]) -> str:
    """One line: FAIL or PASS, then every check that failed and every one that did not run."""
    failed = [r.name for r in results if r.passed is False]
    not_run = [f"{r.name} ({r.skipped})" for r in results if r.passed is None]
    line = f"FAIL: {', '.join(failed)}" if failed else f"PASS: {sum(r.passed is True for r in results)} checks"
    return line + (f"; NOT RUN: {'; '.join(not_run)}" if not_run else "; every check ran")


def cell(value: Value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value).replace("|", "\\|")


def markdown(meta: dict[str, str], results: list[Result]) -> str:
    lines = [f"# Device check: {meta['device']}", "", f"**Verdict: {overall(results)}.**", ""]
    lines += [meta["setup"] + ".", "", f"Software: {meta['software']}.", "", f"Run: {meta['run']}.", "", TWIN_NOTE]
    lines += ["", "| check | result | seconds |", "|---|---|---|"]
    lines += [f"| {cell(r.title)} | {cell(verdict(r))} | {r.seconds:.0f} |" for r in results]
    for r in results:
        if not r.figures and not r.notes:
            continue
        lines += ["", f"## {r.title}: {verdict(r)}", "", f"Criterion: {r.criterion}.", ""]
        if r.figures:
            lines += ["| figure | measured | twin (RTX 4090 model) |", "|---|---|---|"]
            lines += [f"| {cell(f['figure'])} | {cell(f['measured'])} | {cell(f['twin'])} |" for f in r.figures]
        lines += [f"\nNote: {note}" for note in r.notes]
    return "\n".join(lines) + "\n"


def write(meta: dict[str, str], results: list[Result], path: Path) -> list[Path]:
    """The markdown at `path` and the JSON beside it, and both again in $OUT when it is set."""
    text = markdown(meta, results)
    data = json.dumps({"meta": meta, "verdict": overall(results), "results": [asdict(r) for r in results]}, indent=1)
    paths = [path, *([Path(os.environ["OUT"]) / path.name] if os.environ.get("OUT") else [])]
    for md in paths:
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(text)
        md.with_suffix(".json").write_text(data)
    return paths


def run_check(check: Callable[[Session], Result], s: Session) -> Result:
    """The check's result; a check that raises has failed, and the others still run."""
    t0 = time.perf_counter()
    try:
        result = check(s)
    except Exception as e:
        traceback.print_exc()
        result = Result(check.__name__, check.__name__, "runs to its end", passed=False)
        result.notes.append(f"crashed: {type(e).__name__}: {e}")
    s.free()
    result.seconds = time.perf_counter() - t0
    print(f"device_check: {result.name}: {verdict(result)} ({result.seconds:.0f} s)", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    names = [c.__name__ for c in CHECKS]
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and small shapes: the smoke run")
    parser.add_argument("--only", action="append", choices=names, help="run this check only (repeatable)")
    parser.add_argument("--out", type=Path, help=f"the markdown report (default {RESULTS}; with --tiny, a temp file)")
    parser.add_argument("--cuda-tests", type=Path, help="the CUDA-marked tests' JUnit XML (bench/device_check.sh)")
    parser.add_argument("--cuda-tests-exit", type=int, default=0, help="pytest's exit code for that run")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    smoke = Path(tempfile.gettempdir()) / "device_check_smoke.md"
    out = args.out or (smoke if args.tiny else RESULTS)
    config, plan = (TINY, TINY_PLAN) if args.tiny else (llama31_8b_config(), GPU_PLAN)
    s = Session(torch.device(args.device), config, plan, "tiny random Llama" if args.tiny else "random Llama-3.1-8B")
    meta = describe(s, args.tiny, argv)
    results = cuda_test_results(args.cuda_tests, args.cuda_tests_exit) if args.cuda_tests else []
    paths = write(meta, results, out)
    for check in CHECKS:
        if not args.only or check.__name__ in args.only:
            results.append(run_check(check, s))
            paths = write(meta, results, out)
    print(markdown(meta, results))
    print("written to", ", ".join(map(str, paths)))
    if any(r.passed is False for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
