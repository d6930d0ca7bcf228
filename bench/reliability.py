"""Reliability benchmark of issue #13: a schema fuzz, a soak and an overload run against `headroom serve
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
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.report_io import write_report
from bench.server_process import stop
from engine.model.dtype_choice import read_cpu_facts
from engine.serving.standin import FILLER

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"Headroom ready at (http://\S+)")
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0
IDLE_TIMEOUT_S = 15.0  # after a scenario: how long the server may take to free aborted requests' KV
REQUEST_TIMEOUT_S = 300.0  # a request that takes longer counts as hung
FUZZ_MAX_MODEL_LEN = 128
FUZZ_REQUEST_TIMEOUT_S = 30  # 3x the longest generation the fuzz context allows
SOAK_OOM_RATE = 0.01
SOAK_DISCONNECT_SHARE = 0.05
RSS_GROWTH_LIMIT = 0.10
POLL_INTERVAL_S = 0.2
INVALID_PATCH_EVERY = 4  # poll rounds between invalid PATCHes
OVERLOAD_FACTOR = 4
OVERLOAD_PROMPT_TOKENS = 1024
OVERLOAD_MAX_TOKENS = 32
TOKEN_ID_BASE, TOKEN_ID_SPAN = 1000, 30000  # prompt ids, in the range the stand-in tokenizer uses
# Gains the soak's valid PATCHes move away from their value and back (all inside their bounds).
ALTERNATE_GAINS = {"margin_quantile": 0.9, "recovery_step": 0.01, "backoff_cooldown": 8}
# Each must get a 400 and leave the config as it was.
INVALID_PATCHES: tuple[Any, ...] = (
    {"no_such_gain": 1.0},
    {"backoff": 5.0},
    {"margin_quantile": "high"},
    {"backoff_cooldown": 2.5},
    [1, 2],
)


# ---- checks and the report --------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"


@dataclass
class ScenarioResult:
    title: str
    server_command: str
    checks: list[Check]
    seconds: float
    load_before: str
    load_after: str
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def markdown(self) -> list[str]:
        lines = [
            f"## {self.title}",
            "",
            f"Server: `{self.server_command}`",
            "",
            f"Wall time {self.seconds:.0f} s; load average before {self.load_before}, after {self.load_after}.",
            "",
            "| check | result | numbers |",
            "|---|---|---|",
        ]
        lines += [f"| {c.name} | {'PASS' if c.ok else 'FAIL'} | {c.detail} |" for c in self.checks]
        if self.notes:
            lines += ["", *self.notes]
        return [*lines, ""]


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def vector_flags(flags: Iterable[str]) -> list[str]:
    """The CPU flags that decide the kernels (vector and matrix units), for a benchmark's report."""
    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))


def machine_line(load_before: str) -> str:
    """The line a CPU benchmark's report ends with: the CPU, its flags, and the load around the run."""
    facts = read_cpu_facts()
    return (
        f"Machine: {facts.model or 'unknown'}, {os.cpu_count()} CPUs, flags (vector/matrix): "
        f"{' '.join(vector_flags(facts.flags))}; load average {load_before} before the run, {load_average()} after."
    )


def openai_error_problem(body: Any) -> str | None:
    """Why `body` is not an OpenAI error ({"error": {"message", "type", "param", "code"}}), or None."""
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return "not an object with one key 'error'"
    err = body["error"]
    missing = {"message", "type", "param", "code"} - set(err)
    if missing:
        return f"error lacks {sorted(missing)}"
    if not isinstance(err["message"], str) or not isinstance(err["type"], str):
        return "error message or type is not a string"
    return None


# ---- the server under test --------------------------------------------------------------------------


class Server:
    """`headroom serve --backend twin` (or `backend`) as a subprocess on 127.0.0.1 and a free port; use as a
    context manager."""

    def __init__(self, flags: list[str], log: Path, backend: str = "twin") -> None:
        self.argv = ["-m", "engine.serving.cli", "--backend", backend, "--host", "127.0.0.1", "--port", "0", *flags]
        self.log = log
        self.url = ""
        self.proc: subprocess.Popen | None = None

    @property
    def command(self) -> str:
        return "python " + " ".join(self.argv)

    def __enter__(self) -> Server:
        with self.log.open("wb") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, *self.argv], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if m := READY.search(self.log.read_text(errors="replace")):
                self.url = m.group(1)
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"the server did not start:\n{self.log.read_text(errors='replace')[-3000:]}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop(self.proc, STOP_TIMEOUT_S)

    def rss_kib(self) -> int:
        """VmRSS of the server process, from /proc/PID/status."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS line")


def is_idle(counters: dict[str, Any]) -> bool:
    return counters["kv_blocks_used"] == 0 and counters["num_running"] == 0 and counters["num_waiting"] == 0


async def wait_idle(client: httpx.AsyncClient) -> dict[str, Any]:
    """The engine counters (of /controller/state) once nothing runs, waits or holds KV blocks, or as they
    are at the timeout. A failed read is retried until then: the check is of the engine, not the route."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        r = await client.get("/controller/state", params={"steps": 0})
        counters = r.json()["engine"] if r.status_code == 200 else None
        if counters is not None and (is_idle(counters) or time.monotonic() > deadline):
            return counters
        if time.monotonic() > deadline:
            r.raise_for_status()
        await asyncio.sleep(0.2)


def idle_check(name: str, counters: dict[str, Any]) -> Check:
    detail = (
        f"KV blocks in use {counters['kv_blocks_used']} of {counters['kv_blocks_total']}, "
        f"running {counters['num_running']}, waiting {counters['num_waiting']} "
        f"(within {IDLE_TIMEOUT_S:.0f} s of the last answer)"
    )
    return Check(name, is_idle(counters), detail)


def client_for(url: str, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits)


# ---- one generation request and what it must answer -------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    """One request of a scenario. `disconnect_after`: hang up after this many streamed content chunks."""

    chat: bool
    stream: bool
    prompt_tokens: int
    max_tokens: int
    seed: int
    disconnect_after: int | None = None

    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "ignore_eos": True, "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.chat:  # the stand-in tokenizer makes one token of every 4 characters
            body["messages"] = [{"role": "user", "content": "word" * self.prompt_tokens}]
        else:
            rng = random.Random(self.seed)
            body["prompt"] = [TOKEN_ID_BASE + rng.randrange(TOKEN_ID_SPAN) for _ in range(self.prompt_tokens)]
        return body


@dataclass
class Outcome:
    status: int  # HTTP status; 0: no answer (connection error, timeout)
    problem: str | None = None  # why the answer is wrong; None: right
    disconnected: bool = False  # the client hung up on purpose
    retry_after: str | None = None  # of a refusal
    openai_error: bool = False  # a refusal whose body is an OpenAI error


@dataclass
class StreamTally:
    text: str = ""
    content_chunks: int = 0
    finishes: list[str] = field(default_factory=list)
    done: int = 0
    usage: dict[str, Any] | None = None
    errors: list[Any] = field(default_factory=list)
    after_done: int = 0

    def add(self, payload: str, chat: bool) -> None:
        if self.done:
            self.after_done += 1
        if payload == "[DONE]":
            self.done += 1
            return
        obj = json.loads(payload)
        if "error" in obj:
            self.errors.append(obj["error"])
            return
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices", []):
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if piece:
                self.text += piece
                self.content_chunks += 1
            if choice.get("finish_reason") is not None:
                self.finishes.append(choice["finish_reason"])


def answer_problem(spec: RequestSpec, text: str, finishes: list[str], usage: dict[str, Any] | None) -> str | None:
    """Why a finished answer is not the one `spec` must get (ignore_eos: exactly max_tokens filler tokens)."""
    if finishes != ["length"]:
        return f"finish reasons {finishes}, expected ['length']"
    if text != FILLER * spec.max_tokens:
        return f"text of {len(text)} characters, expected {spec.max_tokens} filler tokens"
    if usage is None:
        return "no usage"
    if usage.get("completion_tokens") != spec.max_tokens:
        return f"usage.completion_tokens {usage.get('completion_tokens')}, expected {spec.max_tokens}"
    if not spec.chat and usage.get("prompt_tokens") != spec.prompt_tokens:
        return f"usage.prompt_tokens {usage.get('prompt_tokens')}, expected {spec.prompt_tokens}"
    return None


def refusal_outcome(r: httpx.Response) -> Outcome:
    """A non-200 answer, which is never the right one for a generation request."""
    try:
        shape = openai_error_problem(r.json())
    except ValueError:
        shape = "body is not JSON"
    problem = f"status {r.status_code}" + (f", {shape}" if shape else "")
    return Outcome(r.status_code, problem, retry_after=r.headers.get("retry-after"), openai_error=shape is None)


async def send(client: httpx.AsyncClient, spec: RequestSpec) -> Outcome:
    """Send one request and judge its answer; never raises for what the server answers."""
    try:
        return await (_send_stream(client, spec) if spec.stream else _send_plain(client, spec))
    except httpx.HTTPError as e:
        return Outcome(0, f"no answer: {type(e).__name__}: {e}")
    except (ValueError, LookupError, TypeError) as e:  # JSON that is not an answer's shape
        return Outcome(200, f"malformed answer: {type(e).__name__}: {e}")


async def _send_plain(client: httpx.AsyncClient, spec: RequestSpec) -> Outcome:
    r = await client.post(spec.path(), json=spec.body())
    if r.status_code != 200:
        return refusal_outcome(r)
    body = r.json()
    choice = body["choices"][0]
    text = choice["message"]["content"] if spec.chat else choice["text"]
    return Outcome(200, answer_problem(spec, text, [choice["finish_reason"]], body.get("usage")))


async def _send_stream(client: httpx.AsyncClient, spec: RequestSpec) -> Outcome:
    tally = StreamTally()
    async with client.stream("POST", spec.path(), json=spec.body()) as r:
        if r.status_code != 200:
            await r.aread()
            return refusal_outcome(r)
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            tally.add(line[len("data: ") :], spec.chat)
            if spec.disconnect_after is not None and tally.content_chunks >= spec.disconnect_after:
                problem = f"error event before hanging up: {tally.errors}" if tally.errors else None
                return Outcome(200, problem, disconnected=True)  # leaving the block closes the connection
    if tally.errors:
        return Outcome(200, f"error event: {tally.errors[0]}")
    if tally.done != 1 or tally.after_done:
        return Outcome(200, f"{tally.done} [DONE] events, {tally.after_done} events after the first")
    return Outcome(200, answer_problem(spec, tally.text, tally.finishes, tally.usage))


def count_problems(outcomes: list[Outcome]) -> Counter[str]:
    return Counter(o.problem for o in outcomes if o.problem is not None)


def with_problems(text: str, problems: Counter[str], most: int = 3) -> str:
    """`text`, then the most common problems with their counts."""
    if not problems:
        return text
    return text + "; " + "; ".join(f"{n}x {p}" for p, n in problems.most_common(most))


# ---- fuzz -------------------------------------------------------------------------------------------


# Each part on a fresh server: the fuzzer's valid PATCHes (a cap of 1 sequence, say) would otherwise slow
# every later API case past its timeout, through a config the fuzzer itself set.
FUZZ_PARTS = (("API", ["--exclude-method", "PATCH"]), ("controller PATCH", ["--include-method", "PATCH"]))


def run_fuzz(workdir: Path, max_examples: int, seed: int, phases: str | None = None) -> ScenarioResult:
    """`phases`: schemathesis's --phases (None: all of them; the coverage phase's boundary cases take most
    of the time)."""
    flags = ["--max-model-len", str(FUZZ_MAX_MODEL_LEN)]
    load_before, t0 = load_average(), time.monotonic()
    checks: list[Check] = []
    notes = []
    for i, (part, selection) in enumerate(FUZZ_PARTS):
        json_path, har_path = workdir / f"fuzz{i}.json", workdir / f"fuzz{i}.har"
        out_path = workdir / f"fuzz{i}-schemathesis.txt"
        with Server(flags, workdir / f"fuzz{i}-server.log") as server:
            st = [
                sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json", *selection,
                "--checks", "all", "--mode", "all", "--max-examples", str(max_examples), "--seed", str(seed),
                "--workers", "1", "--continue-on-failure", "--no-shrink",
                "--request-timeout", str(FUZZ_REQUEST_TIMEOUT_S),
                "--report", "json,har", "--report-json-path", str(json_path), "--report-har-path", str(har_path),
                *(["--phases", phases] if phases else []),
            ]  # fmt: skip
            with out_path.open("wb") as fh:
                subprocess.run(st, cwd=workdir, stdout=fh, stderr=subprocess.STDOUT, check=False)
            report, har = json.loads(json_path.read_text()), json.loads(har_path.read_text())
            part_checks = fuzz_checks(report, har, out_path.read_text(errors="replace"))
            part_checks += asyncio.run(_after_fuzz(server.url))
            command = server.command
        checks += [dataclasses.replace(c, name=c.name.replace("fuzz:", f"fuzz ({part}):", 1)) for c in part_checks]
        notes.append(f"schemathesis's own output ({part}): `{out_path}` (with a curl line for each failure).")
    return ScenarioResult(
        "Schema fuzz (schemathesis)", command, checks, time.monotonic() - t0, load_before, load_average(), notes
    )


# Rules that tie two fields (or a field to the model's context) together: JSON Schema cannot state them, so
# a schema-valid request can break one and get its 400, as from vLLM and OpenAI. Matched on the error body.
CROSS_FIELD_RULES = {
    "context_length_exceeded": "prompt + max_tokens over the context",
    "min_tokens must not exceed max_tokens": "min_tokens > max_tokens",
    "top_logprobs needs logprobs": "top_logprobs without logprobs",
}
ST202 = "ST202"


def cross_field_rejections(output: str) -> tuple[Counter[str], int]:
    """From schemathesis's text output: the ST202 (schema-valid request rejected) cases whose error names a
    cross-field rule, by rule, and how many ST202 cases did not."""
    explained: Counter[str] = Counter()
    other = 0
    for block in output.split(f"- {ST202} ")[1:]:
        body = next((line for line in block.splitlines() if '`{"error"' in line), "")
        rule = next((name for key, name in CROSS_FIELD_RULES.items() if key in body), None)
        if rule is None:
            other += 1
        else:
            explained[rule] += 1
    return explained, other


def fuzz_checks(report: dict[str, Any], har: dict[str, Any], output: str = "") -> list[Check]:
    entries = har["log"]["entries"]
    statuses = Counter(e["response"]["status"] for e in entries)
    server_errors = sum(n for s, n in statuses.items() if s >= 500)
    unanswered = statuses.get(0, 0)
    bad_shape: Counter[str] = Counter()
    errors = 0
    for e in entries:
        if e["response"]["status"] < 400:
            continue
        errors += 1
        try:
            problem = openai_error_problem(json.loads(e["response"]["content"].get("text") or ""))
        except ValueError:
            problem = "body is not JSON"
        if problem:
            bad_shape[f"{e['request']['method']} {e['response']['status']}: {problem}"] += 1
    cases = report["test_cases"]
    explained, unexplained = cross_field_rejections(output)
    # ST202 cases that only broke a cross-field rule are not failures of the schema (see CROSS_FIELD_RULES)
    failures = [f for f in report["failures"] if f["code"] != ST202 or unexplained]
    failed_cases = sum(f["count"] for f in failures)
    checks = [
        Check(
            "fuzz: cases run",
            cases["generated"] > 0 and len(entries) >= cases["generated"],
            f"{cases['generated']} cases generated, {len(entries)} requests sent, "
            f"statuses {dict(sorted(statuses.items()))}; stop reason {report['stop_reason']}",
        ),
        Check("fuzz: 0 responses 5xx", server_errors == 0, f"{server_errors} responses 5xx"),
        Check(
            "fuzz: every error OpenAI-shaped",
            not bad_shape,
            with_problems(f"{errors - sum(bad_shape.values())} of {errors} error bodies OpenAI-shaped", bad_shape),
        ),
        Check(
            "fuzz: every request answered",
            unanswered == 0 and not report["errors"],
            f"{unanswered} requests without an answer; schemathesis errors {report['errors']}",
        ),
        Check(
            "fuzz: schema-valid requests refused only by cross-field rules",
            unexplained == 0,
            with_problems(f"{sum(explained.values())} refused by a rule JSON Schema cannot state", explained)
            + f"; {unexplained} refused otherwise",
        ),
        Check(
            "fuzz: schemathesis checks (all)",
            not failures,
            f"{len(failures)} kinds of failure in {failed_cases} cases",
        ),
    ]
    for f in failures:
        checks.append(
            Check(
                f"fuzz: {f['code']} {f['title']}",
                False,
                f"{f['count']} cases on {', '.join(f['operations'])}",
            )
        )
    return checks


async def _after_fuzz(url: str) -> list[Check]:
    async with client_for(url, 4) as client:
        r = await client.get("/health")
        health = Check("fuzz: /health 200 afterwards", r.status_code == 200, f"{r.status_code} {r.text[:200]}")
        return [health, idle_check("fuzz: server idle afterwards", await wait_idle(client))]


# ---- soak -------------------------------------------------------------------------------------------


def soak_plan(n: int, seed: int, disconnect_share: float = SOAK_DISCONNECT_SHARE) -> list[RequestSpec]:
    """Mixed lengths: most prompts short, a quarter up to 1024 tokens, a few up to 2048; outputs of 1
    to 64 tokens. Half stream. A hanging-up client streams at least 32 tokens and leaves by halfway."""
    rng = random.Random(seed)
    plan = []
    for i in range(n):
        u = rng.random()
        prompt = rng.randint(1, 128) if u < 0.7 else rng.randint(129, 1024) if u < 0.95 else rng.randint(1025, 2048)
        max_tokens = rng.choice((1, 4, 16, 32, 64))
        stream = rng.random() < 0.5
        disconnect = None
        if rng.random() < disconnect_share:
            stream, max_tokens = True, max(max_tokens, 32)
            disconnect = rng.randint(1, max_tokens // 2)
        plan.append(RequestSpec(rng.random() < 0.5, stream, prompt, max_tokens, seed + i, disconnect))
    return plan


@dataclass
class PollStats:
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    problems: Counter[str] = field(default_factory=Counter)
    rounds: int = 0

    def count(self, what: str, r: httpx.Response, expected: int) -> None:
        self.statuses[(what, r.status_code)] += 1
        if r.status_code != expected:
            self.problems[f"{what}: {r.status_code}, expected {expected}"] += 1

    def summary(self) -> str:
        return ", ".join(f"{what} {status}: {n}" for (what, status), n in sorted(self.statuses.items()))


async def poll_controller(client: httpx.AsyncClient, stop: asyncio.Event) -> PollStats:
    """GET /metrics, GET /controller/state and PATCH /controller/config until `stop`; the valid PATCHes
    move one gain away from its value and back, the invalid ones must get a 400 and change nothing."""
    stats = PollStats()
    config = (await client.get("/controller/state")).json()["config"]
    original = {gain: config[gain] for gain in ALTERNATE_GAINS}
    while not stop.is_set():
        try:
            config = await _poll_round(client, stats, config, original)
        except (httpx.HTTPError, ValueError, LookupError) as e:  # no answer, or not the answer's shape
            stats.problems[f"{type(e).__name__}: {e}"] += 1
        stats.rounds += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_INTERVAL_S)
    stats.count("PATCH restore", await client.patch("/controller/config", json=original), 200)
    return stats


async def _poll_round(
    client: httpx.AsyncClient, stats: PollStats, config: dict[str, Any], original: dict[str, Any]
) -> dict[str, Any]:
    """One round of polling; the controller config in force after it."""
    stats.count("GET /metrics", await client.get("/metrics"), 200)
    stats.count("GET /controller/state", await client.get("/controller/state", params={"steps": 5}), 200)
    gain = list(ALTERNATE_GAINS)[(stats.rounds // 2) % len(ALTERNATE_GAINS)]
    value = ALTERNATE_GAINS[gain] if stats.rounds % 2 == 0 else original[gain]
    r = await client.patch("/controller/config", json={gain: value})
    stats.count("PATCH valid", r, 200)
    if r.status_code == 200:
        config = r.json()["config"]
    if stats.rounds % INVALID_PATCH_EVERY == 0:
        await _invalid_patch(client, stats, config)
    return config


async def _invalid_patch(client: httpx.AsyncClient, stats: PollStats, config: dict[str, Any]) -> None:
    patch = INVALID_PATCHES[(stats.rounds // INVALID_PATCH_EVERY) % len(INVALID_PATCHES)]
    r = await client.patch("/controller/config", json=patch)
    stats.count("PATCH invalid", r, 400)
    if r.status_code == 400 and (problem := openai_error_problem(r.json())):
        stats.problems[f"PATCH invalid: {problem}"] += 1
    after = (await client.get("/controller/state", params={"steps": 0})).json()["config"]
    if after != config:
        stats.problems[f"PATCH invalid {patch!r} changed the config"] += 1


@dataclass
class SoakRun:
    outcomes: list[Outcome]
    polls: PollStats
    rss_baseline_kib: int
    rss_end_kib: int
    counters: dict[str, Any]
    finished: dict[str, float]  # vllm:request_success_total by finished_reason
    seconds: float


async def _soak(server: Server, plan: list[RequestSpec], concurrency: int) -> SoakRun:
    baseline_at = max(1, len(plan) // 10)
    outcomes: list[Outcome | None] = [None] * len(plan)
    rss_baseline = 0
    done = 0
    indices: Iterator[int] = iter(range(len(plan)))

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done, rss_baseline
        for i in indices:
            outcomes[i] = await send(client, plan[i])
            done += 1
            if done == baseline_at:
                rss_baseline = server.rss_kib()

    t0 = time.monotonic()
    async with client_for(server.url, concurrency + 4) as client:
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_controller(client, stop))
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        seconds = time.monotonic() - t0
        stop.set()
        polls = await poller
        counters = await wait_idle(client)
        metrics = (await client.get("/metrics")).text
    finished = {
        s.labels["finished_reason"]: s.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "vllm:request_success"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert all(o is not None for o in outcomes)
    return SoakRun(outcomes, polls, rss_baseline, server.rss_kib(), counters, finished, seconds)  # type: ignore[arg-type]


def soak_checks(plan: list[RequestSpec], run: SoakRun) -> list[Check]:
    outcomes = run.outcomes
    hung_up = [o for o in outcomes if o.disconnected]
    rest = [o for o in outcomes if not o.disconnected]
    completed = sum(o.problem is None for o in rest)
    problems = count_problems(outcomes)
    statuses = Counter(o.status for o in outcomes) + Counter(status for (_, status) in run.polls.statuses.elements())
    server_errors = sum(n for s, n in statuses.items() if s >= 500)
    finished_total = sum(run.finished.values())
    tokens = sum(p.max_tokens for p, o in zip(plan, outcomes, strict=True) if not o.disconnected)
    c = run.counters
    growth = run.rss_end_kib / run.rss_baseline_kib - 1 if run.rss_baseline_kib else float("inf")
    return [
        Check(
            "soak: every request not hung up on completed, right token count",
            completed == len(rest),
            with_problems(
                f"{completed} of {len(rest)} completed ({tokens} tokens), {len(hung_up)} hung up on purpose, "
                f"{len(plan)} sent in {run.seconds:.0f} s",
                problems,
            ),
        ),
        Check(
            "soak: each request finished exactly once on the server",
            finished_total == len(plan) and run.finished.get("length", 0) >= completed,
            f"vllm:request_success_total {run.finished} (sum {finished_total:.0f}) for {len(plan)} requests",
        ),
        Check("soak: 0 responses 5xx", server_errors == 0, f"{server_errors} of {sum(statuses.values())} responses"),
        Check(
            "soak: /metrics, /controller/state, PATCH /controller/config polled all through",
            run.polls.rounds > 0 and not run.polls.problems,
            with_problems(f"{run.polls.rounds} rounds: {run.polls.summary()}", run.polls.problems),
        ),
        Check(
            "soak: injected OOMs all recovered",
            c["ooms"] > 0 and c["ooms_recovered"] == c["ooms"],
            f"{c['ooms']} OOM steps, {c['ooms_recovered']} recovered, of {c['steps']} steps",
        ),
        idle_check("soak: KV blocks back to 0", c),
        Check(
            f"soak: RSS within {RSS_GROWTH_LIMIT:.0%} of its value after the first tenth",
            growth <= RSS_GROWTH_LIMIT,
            f"{run.rss_baseline_kib / 1024:.1f} MiB after {max(1, len(plan) // 10)} requests, "
            f"{run.rss_end_kib / 1024:.1f} MiB at the end ({growth:+.1%})",
        ),
    ]


def run_soak(workdir: Path, requests: int, concurrency: int, seed: int) -> ScenarioResult:
    plan = soak_plan(requests, seed)
    flags = ["--inject-oom-rate", str(SOAK_OOM_RATE)]
    load_before, t0 = load_average(), time.monotonic()
    with Server(flags, workdir / "soak-server.log") as server:
        run = asyncio.run(_soak(server, plan, concurrency))
        command = server.command
    notes = [
        f"{requests} requests from {concurrency} concurrent clients, seed {seed}: "
        f"{sum(p.stream for p in plan)} streaming, {sum(p.chat for p in plan)} chat, "
        f"{sum(p.disconnect_after is not None for p in plan)} hang up mid-stream; prompts of "
        f"{min(p.prompt_tokens for p in plan)} to {max(p.prompt_tokens for p in plan)} tokens, "
        f"{min(p.max_tokens for p in plan)} to {max(p.max_tokens for p in plan)} output tokens (ignore_eos)."
    ]
    return ScenarioResult(
        "Soak", command, soak_checks(plan, run), time.monotonic() - t0, load_before, load_average(), notes
    )


# ---- overload ---------------------------------------------------------------------------------------


async def _overload(url: str, clients: int) -> tuple[list[Outcome], dict[str, Any]]:
    plan = [RequestSpec(False, i % 2 == 1, OVERLOAD_PROMPT_TOKENS, OVERLOAD_MAX_TOKENS, i) for i in range(clients)]
    async with client_for(url, clients + 4) as client:
        outcomes = await asyncio.gather(*(send(client, spec) for spec in plan))
        return list(outcomes), await wait_idle(client)


def overload_checks(outcomes: list[Outcome], counters: dict[str, Any], max_waiting: int) -> list[Check]:
    statuses = Counter(o.status for o in outcomes)
    refused = [o for o in outcomes if o.status == 429]
    admitted = [o for o in outcomes if o.status == 200]
    other = [o for o in outcomes if o.status not in (200, 429)]
    bad_refusals = Counter(
        f"Retry-After {o.retry_after!r}, {o.problem}" for o in refused
        if not o.openai_error or not (o.retry_after or "").isdigit()
    )  # fmt: skip
    return [
        Check(
            "overload: the queue overflowed",
            len(refused) > 0 and len(admitted) >= max_waiting,
            f"{len(outcomes)} clients at once against --max-waiting {max_waiting}: statuses {dict(statuses)}",
        ),
        Check(
            "overload: every refusal a 429 with Retry-After",
            not other and not bad_refusals,
            with_problems(
                f"{len(refused)} 429s, {len(refused) - sum(bad_refusals.values())} with Retry-After and an OpenAI "
                f"error; {len(other)} other non-200 answers",
                bad_refusals + count_problems(other),
            ),
        ),
        Check(
            "overload: every admitted request completed",
            all(o.problem is None for o in admitted),
            with_problems(
                f"{sum(o.problem is None for o in admitted)} of {len(admitted)} complete", count_problems(admitted)
            ),
        ),
        idle_check("overload: KV blocks back to 0", counters),
    ]


def run_overload(workdir: Path, max_waiting: int) -> ScenarioResult:
    clients = OVERLOAD_FACTOR * max_waiting
    load_before, t0 = load_average(), time.monotonic()
    with Server(["--max-waiting", str(max_waiting)], workdir / "overload-server.log") as server:
        outcomes, counters = asyncio.run(_overload(server.url, clients))
        command = server.command
    notes = [
        f"{clients} non-streaming and streaming completions sent at once, {OVERLOAD_PROMPT_TOKENS} prompt and "
        f"{OVERLOAD_MAX_TOKENS} output tokens each (ignore_eos)."
    ]
    checks = overload_checks(outcomes, counters, max_waiting)
    return ScenarioResult("Overload", command, checks, time.monotonic() - t0, load_before, load_average(), notes)


# ---- main -------------------------------------------------------------------------------------------


def git_commit() -> str:
    """HEAD of the checkout the server runs from, marked dirty when the work tree differs."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    return (git("rev-parse", "--short", "HEAD") or "unknown") + (
        " (uncommitted changes)" if git("status", "--porcelain") else ""
    )


def report_lines(results: list[ScenarioResult], argv: list[str]) -> list[str]:
    lines = [
        "# Reliability (issue #13): fuzz, soak and overload against `headroom serve --backend twin`",
        "",
        f"Command: `python -m bench.reliability {' '.join(argv)}`, at commit {git_commit()}.",
        "",
        f"CPU: {cpu_model()}, {os.cpu_count()} cores visible (shared with other work while this ran); "
        f"Python {sys.version.split()[0]}; {time.strftime('%Y-%m-%d %H:%M %Z')}.",
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
    write_report(args.out, report_lines(results, sys.argv[1:] if argv is None else argv))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
