"""The real plant on the CPU: the server in a memory cgroup whose limit is the device budget.

Why: a container's memory limit is a real capacity. The kernel kills a process whose cgroup goes over it,
as a GPU raises OOM at its capacity. So a server under `fixed` caps that overshoots on a burst of long
prompts dies, while `adaptive` with the sized pool reads the same limit (telemetry/probes/cgroup.py) and
stays under it.

For each policy the script makes a fresh memory cgroup (v1 `memory.limit_in_bytes` or v2 `memory.max`;
root only), starts `python -m engine.serving.cli` (CPU, default model, float32) inside it, on 127.0.0.1,
starts `--decodes` long decodes, waits until they run, then sends a burst of `--burst` long prompts. It
reports requests done, the cgroup's peak (v1 `memory.max_usage_in_bytes`, v2 `memory.peak`) against the
limit, whether the server died and by which signal, and the kernel's OOM-kill count (v1
`memory.oom_control`, v2 `memory.events`). It skips with a message where no cgroup can be made.

    python -m bench.cgroup_plant --limit 4GiB --out bench/results/cgroup_plant.md
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.harness import http
from bench.harness.machine import load_average, machine_line
from bench.harness.report import Stamp, write_report
from bench.harness.server import ServerProcess, free_port, headroom_argv
from telemetry.probes.cgroup import CgroupMemory
from telemetry.units import MIB, parse_bytes

V1_ROOT, V2_ROOT = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
VOCAB_LOW, VOCAB_HIGH = 100, 49_000  # ordinary token ids of SmolLM2's vocabulary
READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 900.0
SAMPLE_S = 0.1


@dataclass
class Run:
    policy: str
    limit: int
    cgroup_version: int
    ready_used: int | None = None  # the cgroup's used memory once the server answered /health
    peak_used: int = 0  # the most it used (less reclaimable page cache) in samples every SAMPLE_S
    sent: int = 0
    done: int = 0
    failed: int = 0
    peak: int | None = None
    oom_kills: int | None = None
    exit_code: int | None = None  # None: the server was alive when the load finished
    kv_pool: dict | None = None
    seconds: float = 0.0


class PlantCgroup:
    """A memory cgroup this script made (and removes): v1 where the memory controller is mounted there."""

    def __init__(self, name: str, limit: int) -> None:
        if V1_ROOT.is_dir():
            self.mem = CgroupMemory(V1_ROOT / name, 1)
        elif "memory" in (V2_ROOT / "cgroup.subtree_control").read_text().split():
            self.mem = CgroupMemory(V2_ROOT / name, 2)
        else:
            raise OSError("no memory cgroup controller is mounted")
        self.mem.path.mkdir()
        limit_file = "memory.limit_in_bytes" if self.mem.version == 1 else "memory.max"
        (self.mem.path / limit_file).write_text(str(limit))

    @property
    def procs(self) -> Path:
        return self.mem.path / "cgroup.procs"

    def oom_kills(self) -> int | None:
        """The kernel's count of processes it killed in this cgroup for going over the limit."""
        name = "memory.oom_control" if self.mem.version == 1 else "memory.events"
        fields = dict(line.split() for line in (self.mem.path / name).read_text().splitlines() if line.strip())
        return int(fields["oom_kill"]) if "oom_kill" in fields else None

    def remove(self) -> None:
        self.mem.path.rmdir()


def server_for(policy: str, cgroup: PlantCgroup, log: Path) -> ServerProcess:
    """The server, joined to the cgroup before it execs, so every byte it allocates is charged there."""
    procs, port = cgroup.procs, free_port()
    argv = headroom_argv(["--device", "cpu", "--dtype", "float32", "--policy", policy], port)
    return ServerProcess(
        argv, log, port, start_timeout=READY_TIMEOUT_S, stop_timeout=60,
        preexec_fn=lambda: procs.write_text(str(os.getpid())),
    )  # fmt: skip


def complete(url: str, prompt: list[int], max_tokens: int) -> bool:
    """One completion; True when it came back whole (a dead server or an error answer: False)."""
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    try:
        r = http.post(url + "/v1/completions", body, timeout=REQUEST_TIMEOUT_S)
        return r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def sample_used(cgroup: PlantCgroup, load: list) -> int:
    """The most the cgroup used (usage less reclaimable page cache) until every request in `load` is back:
    the peak the kernel cannot reclaim, beside max_usage_in_bytes, which counts page cache too."""
    peak = 0
    while not all(f.done() for f in load):
        try:
            peak = max(peak, cgroup.mem.used())
        except (OSError, ValueError):
            break
        time.sleep(SAMPLE_S)
    return peak


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def run(policy: str, limit: int, args: argparse.Namespace) -> Run:
    cgroup = PlantCgroup(f"headroom-plant-{policy}-{os.getpid()}", limit)
    out = Run(policy, limit, cgroup.mem.version)
    server = server_for(policy, cgroup, Path(tempfile.gettempdir()) / f"cgroup-plant-{policy}.log")
    rng = random.Random(args.seed)
    try:
        try:
            server.start()
        except RuntimeError:  # killed or never ready inside the limit: the table says how it died
            out.exit_code = server.proc.poll() if server.proc else None
            return out
        out.ready_used = cgroup.mem.used()
        out.kv_pool = http.get_json(server.url + "/controller/state").get("kv_pool")
        prompts = [(random_prompt(rng, 32), args.decode_tokens) for _ in range(args.decodes)]
        burst = [(random_prompt(rng, args.burst_len), 16) for _ in range(args.burst)]
        out.sent = len(prompts) + len(burst)
        start = time.monotonic()
        with ThreadPoolExecutor(out.sent + 1) as pool:
            load = [pool.submit(complete, server.url, p, n) for p, n in prompts]
            sampler = pool.submit(sample_used, cgroup, load)  # reads the list as the burst joins it
            time.sleep(args.burst_after)
            load += [pool.submit(complete, server.url, p, n) for p, n in burst]
            results = [f.result() for f in load]
            out.peak_used = sampler.result()
        out.seconds = time.monotonic() - start
        out.done = sum(results)
        out.failed = out.sent - out.done
        out.exit_code = server.proc.poll() if server.proc else None
    finally:
        server.stop()
        out.peak = cgroup.mem.peak()
        out.oom_kills = cgroup.oom_kills()
        cgroup.remove()
    return out


def death(code: int | None) -> str:
    if code is None:
        return "alive"
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited {code}"


def report(runs: list[Run], args: argparse.Namespace) -> list[str]:
    lines = [
        "# The real plant: the server in a memory cgroup",
        "",
        "`python -m engine.serving.cli` "
        f"(CPU, default model, `--dtype float32`) in a fresh v{runs[0].cgroup_version} memory cgroup per run, "
        f"limit {args.limit}; {args.decodes} decodes (32-token prompts, {args.decode_tokens} tokens), then after "
        f"{args.burst_after:g} s a burst of {args.burst} prompts of {args.burst_len} tokens (16 tokens each).",
        "",
        "| policy | done / sent | used when ready | used peak (sampled) | cgroup peak | limit | peak / limit | server "
        "| OOM kills | KV pool | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        pool = r.kv_pool or {}
        pool_text = f"{pool['num_blocks']} blocks, sized" if pool.get("sized") else "the backend's default"
        peak = f"{r.peak / MIB:.0f} MiB" if r.peak is not None else "?"
        share = f"{r.peak / r.limit:.3f}" if r.peak is not None else "?"
        ready = f"{r.ready_used / MIB:.0f} MiB" if r.ready_used is not None else "never ready"
        lines.append(
            f"| {r.policy} | {r.done} / {r.sent} | {ready} | {r.peak_used / MIB:.0f} MiB | {peak} | "
            f"{r.limit / MIB:.0f} MiB | {share} | "
            f"{death(r.exit_code)} | {r.oom_kills} | {pool_text} | {r.seconds:.0f} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", default="4GiB", help="the cgroup's memory limit")
    ap.add_argument("--policies", nargs="+", default=["fixed", "adaptive"])
    ap.add_argument("--decodes", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--burst-len", type=int, default=1536)
    ap.add_argument("--burst-after", type=float, default=5.0, help="seconds after the decodes start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    stamp = Stamp("python -m bench.cgroup_plant")
    limit = parse_bytes(a.limit)
    try:
        PlantCgroup(f"headroom-plant-check-{os.getpid()}", limit).remove()
    except OSError as e:
        print(f"skipped: no memory cgroup can be made here ({e})")
        return
    load_before = load_average()
    runs = [run(policy, limit, a) for policy in a.policies]
    write_report(a.out, [*report(runs, a), "", machine_line(load_before)], stamp, [r.__dict__ for r in runs])


if __name__ == "__main__":
    main()
