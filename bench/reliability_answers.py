"""What the reliability scenarios (bench/reliability.py) send and how they judge each answer: the checks
and their report, one generation request and what it must answer, and the server's idle counters."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.harness.http import Answer, request
from engine.model.standin_tokenizer import FILLER

IDLE_TIMEOUT_S = 15.0  # after a scenario: how long the server may take to free aborted requests' KV
REQUEST_TIMEOUT_S = 300.0  # a request that takes longer counts as hung
TOKEN_ID_BASE, TOKEN_ID_SPAN = 1000, 30000  # prompt ids, in the range the stand-in tokenizer uses


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
        a = await request(client, spec.path(), spec.body(), spec.disconnect_after)
    except httpx.HTTPError as e:
        return Outcome(0, f"no answer: {type(e).__name__}: {e}")
    except (ValueError, LookupError, TypeError) as e:  # JSON that is not an answer's shape
        return Outcome(200, f"malformed answer: {type(e).__name__}: {e}")
    return judge(spec, a)


def judge(spec: RequestSpec, a: Answer) -> Outcome:
    if a.status != 200:
        assert a.response is not None
        return refusal_outcome(a.response)
    if a.disconnected:
        return Outcome(200, f"error event before hanging up: {a.errors}" if a.errors else None, disconnected=True)
    if a.errors:
        return Outcome(200, f"error event: {a.errors[0]}")
    if spec.stream and (a.done != 1 or a.after_done):
        return Outcome(200, f"{a.done} [DONE] events, {a.after_done} events after the first")
    return Outcome(200, answer_problem(spec, a.text, a.finishes, a.usage))


def count_problems(outcomes: list[Outcome]) -> Counter[str]:
    return Counter(o.problem for o in outcomes if o.problem is not None)


def with_problems(text: str, problems: Counter[str], most: int = 3) -> str:
    """`text`, then the most common problems with their counts."""
    if not problems:
        return text
    return text + "; " + "; ".join(f"{n}x {p}" for p, n in problems.most_common(most))
