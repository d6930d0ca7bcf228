"""Load generators in virtual time: `vllm bench serve --max-concurrency` (closed loop) and trace replay
(open loop), driving an LLMEngine step by step.

Why in-process and virtual: on the twin a benchmark point that takes half an hour on the card runs in
well under a second, deterministically. The clients behave like vllm bench serve: random prompts of
exactly `input_len` tokens, `ignore_eos` so every request emits exactly `output_len` tokens, a client
sends its next request the moment its previous one finishes, and metrics are computed over successful
requests only.

Fast path: long runs of identical decode-only steps dominate a matrix (a single 4096-token output is
4096 steps). The engine advances those itself where nothing can change the schedule (LLMEngine.decode_burst,
engine/core/decode_burst.py); the load generator only asks. tests/test_twin_latency.py checks that results are
identical with and without it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from engine.core.llm_engine import EngineDeadError, LLMEngine, RequestError
from engine.core.outputs import EngineOutput
from engine.core.sampling_params import SamplingParams
from engine.core.stats import FinishedRequest

PROMPT_VOCAB = 100_000  # filler prompt ids stay below the special tokens (Llama 3: >= 128000)


def filler_prompt(index: int, length: int) -> list[int]:
    """`length` distinct token ids, different for every request (no prefix sharing)."""
    base = index * 7919
    return [1 + (base + j) % PROMPT_VOCAB for j in range(length)]


@dataclass
class TraceRequest:
    input_len: int
    output_len: int
    arrival_time: float = 0.0  # seconds; absolute epoch or from the start: replay is relative to the first
    request_id: str | None = None


@dataclass
class RunResult:
    """Raw outcome of one run: the finished requests and the engine's counters."""

    sequences: list[FinishedRequest] = field(default_factory=list)  # every admitted request that finished, in order
    num_requests: int = 0
    duration: float = 0.0
    ooms: int = 0
    unhealthy: bool = False
    steps: int = 0
    preemptions: int = 0


TRACE_FIELDS = ("input_toks", "output_toks", "arrival_time")


def load_trace(path: str | Path) -> list[TraceRequest]:
    """vLLM's per-request JSONL: `request_id` (optional), `input_toks`, `output_toks`, `arrival_time`
    (absolute epoch seconds are fine: run_trace replays relative to the first arrival), one request a
    line. Other fields are ignored, blank lines skipped; a malformed line is a ValueError naming it."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            missing = [k for k in TRACE_FIELDS if k not in d]
            if missing:
                raise ValueError(f"missing {', '.join(missing)}")
            req = TraceRequest(int(d["input_toks"]), int(d["output_toks"]), float(d["arrival_time"]))
            if req.input_len < 1 or req.output_len < 1:
                raise ValueError("input_toks and output_toks must be at least 1")
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}:{n}: not a trace record ({e})") from e
        rid = d.get("request_id")
        req.request_id = None if rid is None else str(rid)
        out.append(req)
    return out


class _Driver:
    def __init__(self, engine: LLMEngine, fast: bool) -> None:
        self.engine = engine
        self.fast = fast
        self.sent = 0
        self.admitted: list[str] = []  # request ids, in the order they were sent
        self.finished: dict[str, FinishedRequest] = {}
        self.t0 = engine.now()
        engine.finish_listeners.append(self._finished)

    def _finished(self, request: FinishedRequest) -> None:
        self.finished[request.request_id] = request

    def close(self) -> None:
        self.engine.finish_listeners.remove(self._finished)

    def send(self, input_len: int, output_len: int, arrival: float | None = None) -> bool:
        """Submit one request; False when the engine refuses (dead after an OOM, or the request can
        never be served), which the benchmark counts as a failed request."""
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        index = self.sent
        self.sent += 1
        request_id = f"req-{index}"
        try:
            self.engine.add_request(request_id, filler_prompt(index, input_len), params, arrival)
        except (EngineDeadError, RequestError):
            return False
        self.admitted.append(request_id)
        return True

    def step(self, until: float = float("inf")) -> list[EngineOutput] | None:
        """One engine step (or a burst of identical decode steps); returns the outputs of the requests that
        finished, or None when the engine had nothing it could schedule."""
        if self.fast and self.engine.decode_burst(until):
            return []
        before = self.engine.step_id
        touched = self.engine.step()
        if self.engine.step_id == before:
            return None
        return [o for o in touched if o.finish_reason is not None]


def run_closed_loop(
    engine: LLMEngine, concurrency: int, num_requests: int, input_len: int, output_len: int, fast: bool = True
) -> RunResult:
    """`vllm bench serve --max-concurrency concurrency --num-prompts num_requests` with random prompts of
    exactly input_len tokens and ignore_eos. The run ends when every request is done, or when the engine
    dies (a baseline policy's OOM): unsent and unfinished requests then count as failed."""
    d = _Driver(engine, fast)
    try:
        for _ in range(min(concurrency, num_requests)):
            d.send(input_len, output_len)
        while engine.has_unfinished():
            finished = d.step()
            if finished is None:
                break  # nothing schedulable and nothing will arrive: leave the rest unfinished
            if not engine.healthy:
                break
            for _ in finished:
                if d.sent < num_requests:
                    d.send(input_len, output_len)
    finally:
        d.close()
    return _result(d, num_requests)


def run_trace(engine: LLMEngine, requests: Iterable[TraceRequest], fast: bool = True) -> RunResult:
    """Open loop: each request arrives at its recorded time (relative to the first); when the engine is
    idle the virtual clock jumps to the next arrival."""
    reqs = sorted(requests, key=lambda r: r.arrival_time)
    d = _Driver(engine, fast)
    origin = reqs[0].arrival_time if reqs else 0.0
    i = 0
    try:
        while i < len(reqs) or engine.has_unfinished():
            now = engine.now()
            while i < len(reqs) and reqs[i].arrival_time - origin + d.t0 <= now:
                d.send(reqs[i].input_len, reqs[i].output_len, reqs[i].arrival_time - origin + d.t0)
                i += 1
            nxt = reqs[i].arrival_time - origin + d.t0 if i < len(reqs) else float("inf")
            if not engine.healthy:
                i = len(reqs)  # the server is gone: every later request fails
                break
            if not engine.has_unfinished() or d.step(until=nxt) is None:
                if nxt == float("inf"):
                    break
                engine.advance_to(nxt)
    finally:
        d.close()
    return _result(d, len(reqs))


def _result(d: _Driver, num_requests: int) -> RunResult:
    stats = d.engine.stats()
    return RunResult(
        sequences=[d.finished[rid] for rid in d.admitted if rid in d.finished],
        num_requests=num_requests,
        duration=d.engine.now() - d.t0,
        ooms=stats.ooms,
        unhealthy=not stats.healthy,
        steps=stats.steps,
        preemptions=stats.preemptions,
    )
