"""HTTP benchmark helpers for `headroom serve` (see bench/bench_serve.sh).

  export-tokenizer DIR   write the default model's tokenizer (tokenizer.json + tokenizer_config.json) from
                         its GGUF, so offline tools (aiperf, via transformers) can count tokens without a hub
  aiperf-row JSON        one markdown row from aiperf's profile_export_aiperf.json
  loadgen ...            our fallback load generator (httpx, asyncio): closed loop like
                         `vllm bench serve --max-concurrency`; prompts are exactly --input-tokens random
                         token ids (completions API), ignore_eos so every request streams exactly
                         --output-tokens tokens; prints one markdown row and optionally appends JSON

Metrics as aiperf/vLLM define them: TTFT = first streamed token - send; ITL = gaps between streamed
tokens; TPOT = (e2e - TTFT) / (output tokens - 1); output tok/s = all output tokens / run wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.harness import http
from bench.harness.http import Answer


def export_tokenizer(out: Path) -> None:
    from engine.model.loaders import default_model_path
    from engine.model.loaders.gguf import GGUFFile

    tok = GGUFFile(default_model_path()).tokenizer("default")
    out.mkdir(parents=True, exist_ok=True)
    tok.hf.save(str(out / "tokenizer.json"))
    eos = min(tok.eos_token_ids)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 8192,
        "eos_token": tok.token_text(eos),
        "bos_token": tok.token_text(tok.bos_token_id),
        "chat_template": tok.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    print(out)


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], output_tokens: int) -> Answer:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    a = await http.request(client, "/v1/completions", body)
    if a.status != 200 or not a.token_times:
        raise RuntimeError(f"status {a.status}, errors {a.errors}")
    return a


async def loadgen(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.input_tokens)] for _ in range(args.requests)]
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[Answer] = []
    async with http.client(args.url, args.concurrency + 2, timeout=None) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        for _ in range(args.warmup):
            await one_request(client, model, prompts[0][:16], 4)

        async def worker() -> None:
            while not queue.empty():
                results.append(await one_request(client, model, queue.get_nowait(), args.output_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
    summary = summarize(args, results, wall)
    print(row(summary))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(summary) + "\n")
    return summary


def stat(values: list[float]) -> dict:
    values = sorted(values)
    return {
        "mean": statistics.fmean(values),
        "p50": values[len(values) // 2],
        "p90": values[min(len(values) - 1, int(0.9 * len(values)))],
    }


def summarize(args: argparse.Namespace, results: list[Answer], wall: float) -> dict:
    out_tokens = sum(r.output_tokens for r in results)
    return {
        "concurrency": args.concurrency,
        "requests": len(results),
        "input_tokens": args.input_tokens,
        "output_tokens": args.output_tokens,
        "wall_s": wall,
        "ttft_s": stat([r.ttft for r in results]),
        "itl_s": stat([x for r in results for x in r.itl]),
        "tpot_s": stat([(r.e2e - r.ttft) / max(1, r.output_tokens - 1) for r in results]),
        "e2e_s": stat([r.e2e for r in results]),
        "output_tok_s": out_tokens / wall,
        "request_per_s": len(results) / wall,
        "all_exact_output": all(r.output_tokens == args.output_tokens for r in results),
        "all_exact_input": all(r.usage and r.usage["prompt_tokens"] == args.input_tokens for r in results),
    }


def row(summary: dict) -> str:
    ttft, tpot, itl = summary["ttft_s"], summary["tpot_s"], summary["itl_s"]
    cells = [
        str(summary["concurrency"]),
        str(summary["requests"]),
        f"{ttft['mean'] * 1e3:.0f}",
        f"{ttft['p90'] * 1e3:.0f}",
        f"{tpot['mean'] * 1e3:.1f}",
        f"{itl['mean'] * 1e3:.1f}",
        f"{itl['p90'] * 1e3:.1f}",
        f"{summary['output_tok_s']:.1f}",
        f"{summary['wall_s']:.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


def aiperf_row(path: Path) -> None:
    """| concurrency | requests | TTFT avg | TTFT p90 | ITL avg | ITL p90 | chunk gap avg | out tok/s | s |:
    aiperf's ITL is (request latency - TTFT) / (output tokens - 1), i.e. TPOT; the chunk gap is its
    inter_chunk_latency (the time between streamed chunks)."""
    d = json.loads(path.read_text())
    cfg = d.get("input_config", {})
    phases = [ph for ph in cfg.get("phases", []) if ph.get("kind") == "profiling"]
    concurrency = phases[0].get("concurrency", "?") if phases else "?"
    ttft, itl, icl = d["time_to_first_token"], d["inter_token_latency"], d.get("inter_chunk_latency") or {}
    cells = [
        str(concurrency),
        f"{int(d['request_count']['avg'])}",
        f"{ttft['avg']:.0f}",
        f"{ttft['p90']:.0f}",
        f"{itl['avg']:.1f}",
        f"{itl['p90']:.1f}",
        f"{icl.get('avg', float('nan')):.1f}",
        f"{d['output_token_throughput']['avg']:.1f}",
        f"{d['benchmark_duration']['avg']:.0f}",
    ]
    errors = d.get("error_summary") or []
    print("| " + " | ".join(cells) + " |" + (f" errors: {errors}" if errors else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export-tokenizer")
    e.add_argument("dir", type=Path)
    a = sub.add_parser("aiperf-row")
    a.add_argument("json", type=Path)
    g = sub.add_parser("loadgen")
    g.add_argument("--url", default="http://127.0.0.1:8000")
    g.add_argument("--model", default=None)
    g.add_argument("--concurrency", type=int, default=1)
    g.add_argument("--requests", type=int, default=8)
    g.add_argument("--input-tokens", type=int, default=128)
    g.add_argument("--output-tokens", type=int, default=128)
    g.add_argument("--warmup", type=int, default=1)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", default=None, help="append the summary as a JSON line")
    args = p.parse_args(argv)
    if args.cmd == "export-tokenizer":
        export_tokenizer(args.dir)
    elif args.cmd == "aiperf-row":
        aiperf_row(args.json)
    else:
        asyncio.run(loadgen(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
