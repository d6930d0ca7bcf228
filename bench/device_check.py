"""The device check: what the torch backend does on a lent GPU, beside what the twin predicts for the same
requests. `bash bench/device_check.sh` runs it after the CUDA-marked tests; `--device cpu --tiny` is the smoke run
of the default suite (tests/test_device_check.py).

Six checks (bench/device_checks/), each with a pass criterion, its figures and the twin's beside them:
1. token equality between eager and CUDA-graph decode;
2. NVML's readings beside the allocator's over a run;
3. a KV pool grow and shrink with CUDA graphs live;
4. flash-attn's logits against sdpa's (on the CPU: the C++ kernel's);
5. a real OOM, caused by a ballast tensor in a second process, recovered with no request lost;
6. the sized KV pool following a second process's allocation.
The model is a random-weight Llama of Llama-3.1-8B's shape in bf16: nothing is downloaded. The twin models an
RTX 4090 running Llama-3.1-8B, not the lent card (an H200), so its figures are its prediction for the same requests
on its own card, to show how far its model is from a real one; only the device's figures decide a check. The
smoke run takes a tiny model on the CPU: what needs CUDA is skipped there (passed None), the rest runs, the OOM's
second process simulated. Exits 1 when a check fails or crashes. The report is written after every check, so a
run cut short by its time limit still leaves one: bench/results/device_check.md (and .json), and in $OUT too when
that is set (the device tool brings back only what is there).
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

from bench.device_checks.common import GIB, Load, Plan, Result, Session, Value
from bench.device_checks.memory import nvml_vs_allocator, oom_recovery, pool_follows
from bench.device_checks.numerics import flash_vs_sdpa, graphs_vs_eager, kv_resize
from engine.backends.torch_backend import kernel_for
from engine.backends.twin.profile import load_profile
from engine.model.model_config import ModelConfig

RESULTS = Path("bench/results/device_check.md")
# Llama-3.1's rope (HF config.json of meta-llama/Llama-3.1-8B): not in the twin profile, which models memory
# and time, not numerics.
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip
# vocab above 1000: start-up pool sizing fills its prompts with ids up to 1000 (engine/core/kv_pool.py)
TINY = ModelConfig(1024, 64, 128, 2, 4, 2, 16, max_position_embeddings=4096)
GPU_PLAN = Plan(
    pool_tokens=32768,
    decode=Load(24, 64, 32),
    logit_prompts=(1024, 700, 300, 45),
    nvml=Load(48, 256, 48),
    nvml_batch=16,
    resize_tokens=8192,
    oom=Load(4, 1024, 16),
    follow=Load(16, 512, 64),
    follow_steps=(32, 300, 32, 800),
)
TINY_PLAN = Plan(2048, Load(6, 16, 8), (40, 17, 5), Load(16, 16, 48), 4, 256, Load(2, 64, 4), Load(4, 32, 16),
                 (8, 100, 8, 600))  # fmt: skip
CHECKS: tuple[Callable[[Session], Result], ...] = (
    graphs_vs_eager,
    nvml_vs_allocator,
    kv_resize,  # after the two above: it leaves the shared backend's pool resized
    flash_vs_sdpa,
    oom_recovery,
    pool_follows,  # last: its pool takes most of the device
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


def describe(s: Session, smoke: bool, argv: list[str]) -> dict[str, str]:
    kernel = kernel_for("auto", None, s.device, s.dtype)
    if s.cuda:
        device = f"{torch.cuda.get_device_name(s.device)}, {torch.cuda.mem_get_info(s.device)[1] / GIB:.1f} GiB"
    else:
        device = f"CPU ({platform.machine()})"
    packages = ", ".join(f"{p} {version(p)}" for p in ("torch", "flash-attn", "nvidia-ml-py"))
    return {
        "device": device + (", smoke run (not a device result)" if smoke else ""),
        "setup": f"{s.model_name}, {str(s.dtype).removeprefix('torch.')}, attention by default {kernel.attention} "
        f"({kernel.reason}), block size {kernel.block_size}; {packages}; python {platform.python_version()}",
        "run": f"`{' '.join(['python -m bench.device_check', *argv])}` at {time.strftime('%Y-%m-%d %H:%M')}",
    }


def verdict(r: Result) -> str:
    if r.passed is None:
        return r.skipped or "skipped"
    return "PASS" if r.passed else "FAIL"


def cell(value: Value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value).replace("|", "\\|")


def markdown(meta: dict[str, str], results: list[Result]) -> str:
    lines = [f"# Device check: {meta['device']}", "", meta["setup"] + ".", "", f"Run: {meta['run']}.", "", TWIN_NOTE]
    lines += ["", "| check | result | seconds |", "|---|---|---|"]
    lines += [f"| {cell(r.title)} | {verdict(r)} | {r.seconds:.0f} |" for r in results]
    for r in results:
        lines += ["", f"## {r.title}: {verdict(r)}", "", f"Criterion: {r.criterion}.", ""]
        lines += ["| figure | measured | twin (RTX 4090 model) |", "|---|---|---|"]
        lines += [f"| {cell(f['figure'])} | {cell(f['measured'])} | {cell(f['twin'])} |" for f in r.figures]
        lines += [f"\nNote: {note}" for note in r.notes]
    return "\n".join(lines) + "\n"


def write(meta: dict[str, str], results: list[Result], path: Path) -> list[Path]:
    """The markdown at `path` and the JSON beside it, and both again in $OUT when it is set."""
    text = markdown(meta, results)
    data = json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=1)
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
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    smoke = Path(tempfile.gettempdir()) / "device_check_smoke.md"
    out = args.out or (smoke if args.tiny else RESULTS)
    config, plan = (TINY, TINY_PLAN) if args.tiny else (llama31_8b_config(), GPU_PLAN)
    s = Session(torch.device(args.device), config, plan, "tiny random Llama" if args.tiny else "random Llama-3.1-8B")
    meta = describe(s, args.tiny, argv)
    results: list[Result] = []
    paths: list[Path] = []
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
