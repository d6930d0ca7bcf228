"""Start-up time and memory of `headroom serve --model default`: time from launch to the first
`/health` 200, and the server's RSS, on a cold model cache and then on the warm one it left.

    python -m bench.startup [--out bench/results/startup.md] [-- extra serve flags]

Each start runs `python -m engine.serving.cli --model default` on 127.0.0.1 and a free port, with
$HEADROOM_CACHE_DIR pointing at a fresh temporary directory (cold: empty; warm: as the cold start left it).
RSS is read from /proc/PID/status (VmRSS, split into RssAnon and RssFile) once /health answers and again
after one short completion, which touches every weight and writes the first KV blocks: the first number
is the start-up's, the second what serving costs from then on. Where that memory goes comes from a
separate in-process run of the same steps (`stages`): RSS after the interpreter, torch, the server's
imports, the model (loaded from the warm cache and run once), the default KV pool, a 128-token prefill
into it, and for comparison the same pool zeroed eagerly (what a pool resident only where written saves).
Targets: warm start <= 10 s, RSS <= 1.5 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.harness import http
from bench.harness.machine import load_average, machine_line
from bench.harness.report import Stamp, write_report
from bench.harness.server import headroom
from telemetry.units import MIB

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300.0
TARGET_START_S, TARGET_RSS = 10.0, 1536 * MIB
PROMPT_TOKENS = 128  # the stages' prefill


def rss(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


@dataclass
class Start:
    label: str
    seconds_to_health: float
    rss_at_start: dict[str, int]
    rss_after_request: dict[str, int]
    log_tail: str


def start_once(label: str, cache_dir: Path, flags: list[str], log: Path) -> Start:
    """Launch the server, wait for /health 200, read its RSS, send one completion, read it again, stop it."""
    env = {**os.environ, "HEADROOM_CACHE_DIR": str(cache_dir)}
    with headroom(["--model", "default", *flags], log, env=env, start_timeout=START_TIMEOUT_S) as server:
        assert server.proc is not None
        at_start = rss(server.proc.pid)
        body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        r = http.post(server.url + "/v1/completions", body)
        if r.status_code != 200:
            raise RuntimeError(f"{label}: completion answered {r.status_code}:\n{server.log_tail()}")
        after = rss(server.proc.pid)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:])
    return Start(label, server.seconds_to_health, at_start, after, tail)


def stages() -> list[tuple[str, int]]:
    """(step, VmRSS after it) for the server's start-up steps, in this process (run it in a fresh one)."""
    out = [("python interpreter", rss()["VmRSS"])]
    import torch

    out.append(("import torch", rss()["VmRSS"]))
    import engine.serving.launch  # noqa: F401 - the server's imports (fastapi, the engine, telemetry)
    from engine.backends.torch_backend import CPU_KV_TOKENS
    from engine.core.kv.tensors import allocate_kv_cache
    from engine.model.attention import build_attention_metadata
    from engine.model.dtype_choice import choose_dtype
    from engine.model.loaders import load
    from engine.model.loaders.cache import ModelCache

    out.append(("server imports", rss()["VmRSS"]))
    dtype = choose_dtype("auto", torch.device("cpu")).dtype
    loaded = load("default", dtype, cache=ModelCache())
    model, block_size = loaded.model, 16

    def prefill(kv: list, blocks: list[int]) -> None:
        meta = build_attention_metadata([(0, PROMPT_TOKENS, blocks)], block_size, "cpu")
        with torch.inference_mode():
            model.compute_logits(model(torch.arange(PROMPT_TOKENS), torch.arange(PROMPT_TOKENS), kv, meta)[-1:])

    blocks = list(range(PROMPT_TOKENS // block_size))
    prefill(allocate_kv_cache(loaded.config, len(blocks), block_size, dtype, "cpu"), blocks)
    out.append((f"model ({str(dtype).removeprefix('torch.')}, from the warm cache, run once)", rss()["VmRSS"]))
    kv = allocate_kv_cache(loaded.config, CPU_KV_TOKENS // block_size, block_size, dtype, "cpu")
    pool = sum(t.nbytes for pair in kv for t in pair)
    out.append((f"default KV pool allocated ({pool / MIB:.0f} MiB of tensors)", rss()["VmRSS"]))
    prefill(kv, blocks)
    out.append((f"{PROMPT_TOKENS}-token prefill into the pool", rss()["VmRSS"]))
    shapes = [t.shape for pair in kv for t in pair]
    del kv
    eager = [torch.zeros(shape, dtype=dtype) for shape in shapes]  # noqa: F841 - held while RSS is read
    out.append(("that pool made by torch.zeros instead (written up front)", rss()["VmRSS"]))
    return out


def mib(n: int) -> str:
    return f"{n / MIB:.0f}"


def verdict(met: bool) -> str:
    return "**met**" if met else "**MISSED**"


def report(flags: list[str], starts: list[Start], steps: list[tuple[str, int]], load_before: str) -> list[str]:
    warm = next(s for s in starts if s.label == "warm")
    worst_rss = max(s.rss_after_request["VmRSS"] for s in starts)
    lines = [
        "# Start-up time and RSS of `headroom serve --model default`",
        "",
        f"Server: `{' '.join(['python -m engine.serving.cli --model default --port N', *flags])}`.",
        machine_line(load_before),
        "",
        "Time from launch to the first `/health` 200; RSS from /proc/PID/status once /health answers, and after",
        "one 8-token completion (every weight touched, the first KV blocks written).",
        "",
        "| start | to /health 200 (s) | RSS at start (MiB) | anon / file | RSS after a request (MiB) | anon / file |",
        "|---|---|---|---|---|---|",
    ]
    for s in starts:
        a, b = s.rss_at_start, s.rss_after_request
        lines.append(
            f"| {s.label} | {s.seconds_to_health:.1f} | {mib(a['VmRSS'])} | {mib(a['RssAnon'])} / {mib(a['RssFile'])} "
            f"| {mib(b['VmRSS'])} | {mib(b['RssAnon'])} / {mib(b['RssFile'])} |"
        )
    lines += [
        "",
        f"Targets: warm start <= {TARGET_START_S:.0f} s: {verdict(warm.seconds_to_health <= TARGET_START_S)} "
        f"({warm.seconds_to_health:.1f} s); RSS <= {TARGET_RSS / MIB:.0f} MiB: {verdict(worst_rss <= TARGET_RSS)} "
        f"(highest {mib(worst_rss)} MiB).",
        "",
        "## Where the RSS goes",
        "",
        "The same steps in one process (`stages`), VmRSS after each:",
        "",
        "| step | VmRSS (MiB) | added (MiB) |",
        "|---|---|---|",
    ]
    before = 0
    for name, value in steps:
        lines.append(f"| {name} | {mib(value)} | {mib(value - before)} |")
        before = value
    lines += [
        "",
        "RssFile counts the weights mapped from the cache entry's model.safetensors (page cache, shared and",
        "reclaimable) once they are touched; on a cold start the converted weights are anonymous memory instead.",
        "The KV pool's pages become resident as blocks are written (engine/core/kv/tensors.py: zeroed_kv_tensor); the",
        "last row is what zeroing the whole pool at start-up cost.",
        "",
        "Server log, warm start (tail):",
        "",
        "```",
        warm.log_tail,
        "```",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__)
    p.add_argument("--out", default=str(ROOT / "bench/results/startup.md"))
    p.add_argument("--stages", action="store_true", help="print the in-process RSS stages as JSON and exit")
    p.add_argument("flags", nargs="*", help="extra `headroom serve` flags (after --)")
    args = p.parse_args(argv)
    stamp = Stamp("python -m bench.startup", argv)
    if args.stages:
        print(json.dumps(stages()))
        return 0
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="headroom-startup-") as tmp:
        cache = Path(tmp) / "cache"
        starts = [start_once(label, cache, args.flags, Path(tmp) / f"{label}.log") for label in ("cold", "warm")]
        env = {**os.environ, "HEADROOM_CACHE_DIR": str(cache)}  # the stages load from the warm cache
        run = subprocess.run(
            [sys.executable, "-m", "bench.startup", "--stages"], cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=START_TIMEOUT_S, check=True,
        )  # fmt: skip
    steps = [tuple(step) for step in json.loads(run.stdout.splitlines()[-1])]
    lines = report(args.flags, starts, steps, load_before)
    write_report(args.out, lines, stamp, {"starts": [asdict(s) for s in starts], "stages": steps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
