"""Load generators in virtual time: `vllm bench serve --max-concurrency` (closed loop) and trace replay
(open loop), driving an LLMEngine step by step.

Why in-process and virtual: on the twin a benchmark point that takes half an hour on the card runs in
well under a second, deterministically. The clients behave like vllm bench serve: random prompts of
exactly `input_len` tokens, `ignore_eos` so every request emits exactly `output_len` tokens, a client
sends its next request the moment its previous one finishes, and metrics are computed over successful
requests only.

Fast path: long runs of identical decode-only steps dominate a matrix (a single 4096-token output is
4096 steps). When nothing can change the schedule -- a static policy, no arrival due, no sequence about
to finish, nothing admissible waiting, KV blocks to spare -- `_decode_burst` advances those steps itself
through the twin's own `decode_step` and the sequences' bookkeeping, skipping only schedule() (which
would return the same batch) and the no-op policy feedback. tests/test_twin_latency.py checks that
results are identical with and without it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from controller.policy import StaticPolicy
from engine.core.batch import SchedulerOutput
from engine.core.llm_engine import EngineDeadError, LLMEngine, RequestError
from engine.core.outputs import EngineOutput
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence, Status
from telemetry.record import StepRecord

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
    """Raw outcome of one run: the finished sequences and the engine's counters."""

    sequences: list[Sequence] = field(default_factory=list)  # every request that was admitted, finished
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
        self.backend = engine.backend
        self.sent = 0
        self.seqs: list[Sequence] = []
        self.last: SchedulerOutput | None = None
        self.added = False  # a request arrived since the last engine step: the schedule may change
        # The backend's class must define decode_step (a wrapper such as the fault injector, which delegates
        # it, must not be bypassed) and the policy must be one whose feedback is a no-op.
        pol = type(engine.policy)
        self.fast = (
            fast
            and hasattr(type(self.backend), "decode_step")
            and issubclass(pol, StaticPolicy)
            and pol.observe is StaticPolicy.observe
            and pol.step_budget is StaticPolicy.step_budget
        )
        self.t0 = self.backend.now()
        self._listener: Callable[[StepRecord, SchedulerOutput], None] = self._capture
        engine.step_listeners.append(self._listener)

    def _capture(self, record: StepRecord, batch: SchedulerOutput) -> None:
        self.last = batch

    def close(self) -> None:
        self.engine.step_listeners.remove(self._listener)

    def send(self, input_len: int, output_len: int, arrival: float | None = None) -> bool:
        """Submit one request; False when the engine refuses (dead after an OOM, or the request can
        never be served), which the benchmark counts as a failed request."""
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        index = self.sent
        self.sent += 1
        try:
            seq = self.engine.add_request(f"req-{index}", filler_prompt(index, input_len), params, arrival)
        except (EngineDeadError, RequestError):
            return False
        self.seqs.append(seq)
        self.added = True
        return True

    def step(self, until: float = float("inf")) -> list[EngineOutput] | None:
        """One engine step (or a burst of identical decode steps); returns the outputs of the requests that
        finished, or None when the engine had nothing it could schedule."""
        if self.fast and self._decode_burst(until):
            return []
        before = self.engine.step_id
        self.last, self.added = None, False
        touched = self.engine.step()
        if self.engine.step_id == before:
            return None
        return [o for o in touched if o.finish_reason is not None]

    def _decode_burst(self, until: float) -> bool:
        """Advance identical decode-only steps without the scheduler (see the module docstring for why
        this is exact). Returns True when it ran at least one step."""
        engine, batch = self.engine, self.last
        if batch is None or self.added or batch.preempted or not engine.healthy or len(engine.step_listeners) != 1:
            return False
        if any(it.is_prefill for it in batch.items):
            return False
        seqs = [engine.requests.get(it.request_id) for it in batch.items]
        if any(s is None or s.status is not Status.RUNNING for s in seqs):
            return False
        sched = engine.scheduler
        if any(not s.is_decode for s in sched.running):
            return False
        if any(s.params.stop_token_ids or s.params.stop for s in seqs):
            return False
        # Stop one step short of the first finish: that step (and its bookkeeping) is the engine's.
        k = min(s.max_tokens - len(s.output_ids) for s in seqs) - 1
        if k <= 0:
            return False
        alloc = sched.allocator
        grow = sum(max(0, alloc.blocks_for(s.num_tokens + k - 1) - len(s.block_table)) for s in seqs)
        if grow > alloc.num_free:
            return False
        backend, n, done = self.backend, len(seqs), 0
        bs, token_at = alloc.block_size, backend.token_at
        context = sum(s.num_computed + 1 for s in seqs)
        for _ in range(k):
            if not backend.decode_step(n, context, until):
                break
            now = backend.now()
            for s in seqs:
                pos = s.num_computed  # the KV slot this step writes (the scheduler's _grow_for_decode)
                if pos >= len(s.block_table) * bs:
                    alloc.allocate_slots(s, 1)
                s.num_computed = pos + 1
                s.output_ids.append(token_at(pos + 1))
                s.token_times.append(now)
            context += n
            done += 1
        engine.step_id += done
        return done > 0


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
    backend = engine.backend
    origin = reqs[0].arrival_time if reqs else 0.0
    i = 0
    try:
        while i < len(reqs) or engine.has_unfinished():
            now = backend.now()
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
                backend.advance_to(nxt)
    finally:
        d.close()
    return _result(d, len(reqs))


def _result(d: _Driver, num_requests: int) -> RunResult:
    e = d.engine
    return RunResult(
        sequences=[s for s in d.seqs if s.finished],
        num_requests=num_requests,
        duration=d.backend.now() - d.t0,
        ooms=e.ooms,
        unhealthy=not e.healthy,
        steps=e.step_id,
        preemptions=e.scheduler.num_preemptions,
    )
