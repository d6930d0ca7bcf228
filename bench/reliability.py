"""Reliability benchmark: a schema fuzz, a soak and an overload run against `headroom serve
--backend twin`, each on a fresh server started as a subprocess on 127.0.0.1.

- fuzz: schemathesis (CLI, all checks, negative and positive data) against /openapi.json. Its JSON report
  gives the case count and the failures by check; its HAR file gives every response, which this script
  reads for 5xx, non-OpenAI-shaped errors and requests that got no answer. Then /health must be 200 and
  the server idle (KV blocks back to 0). The server runs the twin with `--max-model-len 128`: a
  schema-valid chat request without max_tokens generates up to the context, and the twin runs in real
  time (about 17 ms a token alone), so the full 131072-token context would turn such a case into a
  40-minute request.
- soak: N requests (completions and chat, streaming and not, prompt lengths from 1 to 2048 tokens,
  ignore_eos so each produces exactly max_tokens filler tokens), 1% of engine steps failing with an
  injected OOM (--inject-oom-rate), a share of streaming clients hanging up mid-stream, and
  /metrics, /controller/state and PATCH /controller/config (valid gains and invalid ones, which must get
  a 400 and change nothing) polled all through. Checks: every request not hung up on completed exactly
  once with the right text and token count (client side: one finish, one [DONE]; server side: the
  vllm:request_success_total counters add up to the requests sent), no 5xx, every OOM recovered, KV
  blocks back to 0, and the server's RSS at the end within 10% of its RSS after the first tenth of the
  requests (1,000 of 10,000).
- overload: 4x --max-waiting clients at once, long prompts so few run at a time. Every refused request
  gets a 429 with Retry-After and an OpenAI-shaped body, every admitted one completes, and some were
  refused (else the run did not overload the server).

Each check prints PASS or FAIL with its numbers; the exit status is 1 if any check failed. Run from the
repository root:

    python -m bench.reliability all --out bench/results/reliability.md
    python -m bench.reliability soak --requests 500      # one scenario, smaller
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.machine import load_average, machine_line
from bench.harness.report import Stamp, write_report
from bench.reliability_answers import ScenarioResult
from bench.reliability_fuzz import run_fuzz
from bench.reliability_soak import run_overload, run_soak


def report_lines(results: list[ScenarioResult], load_before: str) -> list[str]:
    lines = [
        "# Reliability: fuzz, soak and overload against `headroom serve --backend twin`",
        "",
        f"{machine_line(load_before)} Shared with other work while this ran; {time.strftime('%Y-%m-%d %H:%M %Z')}.",
        "The twin runs in real time (the server sleeps each step's modelled duration), so request latencies "
        "are the modelled RTX 4090 + Llama-3.1-8B ones plus this CPU's overhead.",
        "",
    ]
    for res in results:
        lines += res.markdown()
    verdict = "all checks PASS" if all(r.ok for r in results) else "some checks FAIL"
    return [*lines, f"Verdict: {verdict}."]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.reliability", description=__doc__.splitlines()[0])
    ap.add_argument("scenario", choices=("fuzz", "soak", "overload", "all"))
    ap.add_argument("--max-examples", type=int, default=100, help="fuzz: schemathesis cases per operation")
    ap.add_argument("--requests", type=int, default=10_000, help="soak: requests")
    ap.add_argument("--concurrency", type=int, default=64, help="soak: concurrent clients")
    ap.add_argument("--max-waiting", type=int, default=64, help="overload: the server's queue bound")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="server logs and fuzz reports (default: a new temp dir)")
    ap.add_argument("--out", default=None, help="markdown report")
    args = ap.parse_args(argv)
    stamp, load_before = Stamp("python -m bench.reliability", argv), load_average()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="headroom-reliability-"))
    workdir.mkdir(parents=True, exist_ok=True)
    scenarios = {
        "fuzz": lambda: run_fuzz(workdir, args.max_examples, args.seed),
        "soak": lambda: run_soak(workdir, args.requests, args.concurrency, args.seed),
        "overload": lambda: run_overload(workdir, args.max_waiting),
    }
    results = []
    for name, run in scenarios.items():
        if args.scenario in (name, "all"):
            results.append(run())
            for check in results[-1].checks:
                print(check.line(), flush=True)
    print(f"logs and reports in {workdir}")
    write_report(args.out, report_lines(results, load_before), stamp)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
