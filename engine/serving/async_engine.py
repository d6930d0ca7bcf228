"""The engine's background loop: one thread owns the LLMEngine; the asyncio side talks to it by message.

Why a thread: the scheduler, KV allocator and policy are single-threaded, and a step is mostly torch
kernels that release the GIL, so the event loop stays responsive while the engine computes. Requests and
aborts go in through a thread-safe command queue (applied between steps, so an abort frees its KV blocks
before the next step). Right after each step the engine thread runs the output processor over the step's
token ids (text, stop strings, logprobs: engine/frontend/), aborts in the core the requests a stop string
ended, so none computes a token past its stop, and sends each request its `RequestOutput` through one
`loop.call_soon_threadsafe` per step: the event loop decodes nothing. A request's error (bad parameters, too
long) is answered on that request only; an exception from the step itself kills the loop, every open
request is failed, and /health turns 503.

Nothing else touches the engine's objects. Other threads read `snapshot` and `info` (engine/serving/
messages.py) or call a typed query (`controller_state`, `controller_stats`, `update_config`,
`prefill_load`), run on the engine thread between steps, promptly when idle. Once the loop has ended,
queries are refused and the controller's state and stats answer from the last ones the engine thread
produced.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.core.batch import SchedulerOutput
from engine.core.llm_engine import EngineDeadError, LLMEngine
from engine.core.outputs import EngineOutput
from engine.core.sampling_params import SamplingParams
from engine.core.stats import FinishedRequest
from engine.frontend.output_processor import OutputProcessor, Resume
from engine.model.standin_tokenizer import StandInTokenizer
from engine.serving.handles import ACCEPTED, RequestHandle, deliver
from engine.serving.messages import ControllerStats, EngineInfo, EngineSnapshot, PrefillLoad
from telemetry.phases import PhaseTimer
from telemetry.record import StepRecord

logger = logging.getLogger("headroom.server")

IDLE_POLL_S = 1.0  # how long the idle loop blocks on the command queue before re-checking for stop
DRAIN_POLL_S = 0.05  # how often a graceful drain checks whether the open requests have finished
ABORT_WAIT_S = 10.0  # after the grace period: how long to wait for the aborted requests to be answered

T = TypeVar("T")


class QueueFullError(RuntimeError):
    """The waiting queue is over `max_waiting`: the API answers 429 with Retry-After."""

    def __init__(self, waiting: int, bound: int, retry_after: int = 1) -> None:
        super().__init__(f"the server is overloaded: {waiting} requests waiting (bound {bound}); retry later")
        self.retry_after = retry_after


def refuse_when_full(waiting: int, bound: int) -> None:
    """The server's 429: a request is refused once `waiting` requests wait for their first step (the fleet's
    simulated replicas apply the same rule, bench/fleet/replica.py). Raises QueueFullError."""
    if waiting >= bound:
        raise QueueFullError(waiting, bound)


@dataclass
class _Add:
    handle: RequestHandle
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    resume: Resume | None


@dataclass
class AsyncEngine:
    engine: LLMEngine
    max_waiting: int = 256
    on_step: list[Callable[[StepRecord], None]] = field(default_factory=list)
    on_finish: list[Callable[[FinishedRequest], None]] = field(default_factory=list)
    warm_up: Callable[[], None] | None = None  # run on the engine thread before its first step
    tokenizer: Any = None  # the text's; None: the backend's, else the stand-in (the twin has none)

    def __post_init__(self) -> None:
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submit against death/stop, guards _pending
        self._pending = 0  # adds queued but not yet applied
        self._handles: dict[str, RequestHandle] = {}  # engine thread only: accepted, not finished
        tokenizer = self.tokenizer or self.engine.backend.tokenizer or StandInTokenizer()
        self._processor = OutputProcessor(tokenizer)  # engine thread only
        self._outbox: list[tuple[RequestHandle | asyncio.Future[Any], Any]] = []  # engine thread only
        self._ids = itertools.count()
        self._phases = PhaseTimer()  # this loop's own share of a step: detokenizing, streaming, the snapshot
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False  # no more adds: draining or stopped
        self._closed = False  # the loop has ended: no more commands are applied
        self.error: BaseException | None = None
        self.snapshot = EngineSnapshot.of(self.engine, 0)
        self.info = EngineInfo.of(self.engine)
        self._last_state: dict[str, Any] = self.engine.policy.state()
        self._last_stats: ControllerStats = self.engine.policy.stats()
        self.engine.step_listeners.append(self._step_listener)
        self.engine.finish_listeners.append(self._finish_listener)

    # ---- lifecycle (event loop thread) -------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="headroom-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
        self._commands.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)

    def begin_drain(self) -> None:
        """Stop admitting (new requests get EngineDeadError, a 503); open requests keep running."""
        with self._lock:
            self._stopping = True

    @property
    def draining(self) -> bool:
        return self._stopping and not self._closed

    async def drain(self, grace: float) -> int:
        """Stop admitting, let the open requests finish for up to `grace` seconds, then abort the rest.
        Returns how many were aborted."""
        self.begin_drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.num_unfinished() and loop.time() < deadline and not self._closed:
            await asyncio.sleep(DRAIN_POLL_S)
        left = self.num_unfinished()
        if left and not self._closed:
            self._commands.put(("abort_all",))
            deadline = loop.time() + ABORT_WAIT_S
            while self.num_unfinished() and loop.time() < deadline and not self._closed:
                await asyncio.sleep(DRAIN_POLL_S)
        return left

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def healthy(self) -> bool:
        return self.alive and self.snapshot.stats.healthy

    def num_waiting(self) -> int:
        return self.snapshot.stats.num_waiting + self._pending

    def num_running(self) -> int:
        return self.snapshot.stats.num_running

    def num_unfinished(self) -> int:
        """Requests accepted or queued for acceptance, and not finished."""
        return self.snapshot.num_requests + self._pending

    # ---- queries (event loop thread) ---------------------------------------------------------------
    async def _query(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result (its exception is
        raised here). EngineDeadError when the loop is not running."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._thread is None or self._closed:
                raise EngineDeadError(self.dead_reason())
            self._commands.put(("query", fn, future))
        return await future

    async def controller_state(self) -> dict[str, Any]:
        """The controller's rich state (GET /controller/state), fresh; the last one seen once the loop died."""
        with contextlib.suppress(EngineDeadError):
            self._last_state = await self._query(lambda engine: engine.policy.state())
        return self._last_state

    async def controller_stats(self) -> ControllerStats:
        """What metrics export of the controller, fresh; the last one seen once the loop died."""
        with contextlib.suppress(EngineDeadError):
            self._last_stats = await self._query(lambda engine: engine.policy.stats())
        return self._last_stats

    async def update_config(self, patch: dict[str, Any]) -> dict[str, Any]:
        """Apply a controller config patch on the engine thread; the policy's ValueError is raised here."""

        def apply(engine: LLMEngine) -> dict[str, Any]:
            engine.policy.update_config(patch)
            return engine.policy.state()

        self._last_state = await self._query(apply)
        return self._last_state

    async def prefill_load(self) -> PrefillLoad:
        """What a fleet's router reads; EngineDeadError when the loop is not running."""
        return await self._query(PrefillLoad.of)

    def phase_totals(self) -> dict[str, float]:
        """A step's seconds by phase: the engine's, and this loop's after each step (both timers thread-safe)."""
        ours = self._phases.totals()
        return {phase: seconds + ours[phase] for phase, seconds in self.engine.phase_totals().items()}

    # ---- requests (event loop thread) --------------------------------------------------------------
    async def add(self, prompt_ids: list[int], params: SamplingParams, resume: Resume | None = None) -> RequestHandle:
        """Queue a request and wait until the engine accepted it. Raises the engine's RequestError (400),
        EngineDeadError (503) or QueueFullError (429). `resume`: a stream a replica that died had begun."""
        handle = RequestHandle(f"req-{next(self._ids)}", len(prompt_ids), self._request_abort)
        handle.num_tokens = len(resume.token_ids) if resume else 0  # usage counts what the client got
        arrival = self.engine.now()  # a clock read: thread-safe on every backend
        with self._lock:
            if self.error is not None or self._stopping or not self.snapshot.stats.healthy:
                raise EngineDeadError(self.dead_reason())
            refuse_when_full(self.num_waiting(), self.max_waiting)
            self._pending += 1
            self._commands.put(("add", _Add(handle, list(prompt_ids), params, arrival, resume)))
        try:
            await handle.accepted()
        except asyncio.CancelledError:
            handle.abort()
            raise
        return handle

    def _request_abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def dead_reason(self) -> str:
        if self.error is not None:
            return f"the engine loop stopped: {type(self.error).__name__}: {self.error}"
        if self._stopping:
            return "the server is shutting down"
        if self._thread is None:
            return "the engine loop has not started"
        return "the engine is unhealthy after an out-of-memory error its policy cannot recover from"

    # ---- the loop (engine thread) ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.warm_up is not None:
                self.warm_up()
            while True:
                if not self._drain(block=not self.engine.has_unfinished()):
                    break
                self._flush()
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    phases = self._phases
                    with phases.span("detokenize_stream"):
                        self._publish(outputs)
                    with phases.span("telemetry"):
                        self.snapshot = EngineSnapshot.of(self.engine, len(self._handles))
                    with phases.span("detokenize_stream"):
                        self._flush()
        except BaseException as e:  # noqa: BLE001 - anything that escapes a step ends the loop
            logger.exception("the engine loop died")
            self.error = e
        self._keep_last_state()
        self._fail_all(EngineDeadError(self.dead_reason()))

    def _keep_last_state(self) -> None:
        """What the controller queries answer once the loop is gone (the policy may be broken by what
        killed it)."""
        try:
            self._last_state = self.engine.policy.state()
            self._last_stats = self.engine.policy.stats()
        except Exception:  # noqa: BLE001
            logger.exception("cannot read the controller's last state")

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; blocks for the first when idle. False on a stop command. The snapshot
        is republished together with the count of adds applied, so num_waiting never misses one."""
        try:
            cmd = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        added = 0
        try:
            while cmd[0] != "stop":
                self._apply(cmd)
                added += cmd[0] == "add"
                cmd = self._commands.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            self._pending -= added
            self.snapshot = EngineSnapshot.of(self.engine, len(self._handles))
        return cmd[0] != "stop"

    def _apply(self, cmd: tuple[Any, ...]) -> None:
        kind = cmd[0]
        if kind == "add":
            self._apply_add(cmd[1])
        elif kind == "abort":
            self._abort(cmd[1])
        elif kind == "abort_all":
            for rid in list(self._handles):
                self._abort(rid)
        elif kind == "query":
            self._answer(cmd[1], cmd[2])

    def _answer(self, fn: Callable[[LLMEngine], Any], future: asyncio.Future[Any]) -> None:
        try:
            result = fn(self.engine)
        except Exception as e:  # noqa: BLE001 - the asker's error (a bad config patch), not the loop's
            result = e
        self._outbox.append((future, result))

    def _apply_add(self, add: _Add) -> None:
        rid = add.handle.request_id
        try:
            produced = add.resume.token_ids if add.resume else ()
            self.engine.add_request(rid, add.prompt_ids, add.params, add.arrival_time, produced)
        except Exception as e:  # noqa: BLE001 - a request's error is that request's answer, never the loop's
            self._outbox.append((add.handle, e))
            return
        self._processor.add_request(rid, add.params, add.prompt_ids, add.resume)
        self._handles[rid] = add.handle
        self._outbox.append((add.handle, ACCEPTED))

    def _abort(self, request_id: str) -> None:
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            self.engine.abort(request_id)
            self._outbox.append((handle, self._processor.abort(request_id)))

    def _publish(self, outputs: list[EngineOutput]) -> None:
        """The step's outputs through the output processor, once: a stop string it finds ends the request in
        the core now, before the next step; each request's message goes to its handle."""
        processed = self._processor.process(outputs)
        for request_id in processed.to_abort:
            self.engine.abort(request_id, "stop")
        for out in processed.outputs:
            handle = self._handles.pop(out.request_id) if out.finish_reason else self._handles[out.request_id]
            self._outbox.append((handle, out))

    def _finish_listener(self, request: FinishedRequest) -> None:
        for listener in self.on_finish:
            self._call(listener, request)

    def _step_listener(self, record: StepRecord, batch: SchedulerOutput) -> None:
        for listener in self.on_step:
            self._call(listener, record)

    @staticmethod
    def _call(listener: Callable[[Any], None], arg: Any) -> None:
        """Telemetry must not take serving down: a failing listener is logged, not raised."""
        try:
            listener(arg)
        except Exception:  # noqa: BLE001
            logger.exception("listener %r failed", listener)

    def _flush(self) -> None:
        if not self._outbox or self._loop is None:
            return
        batch, self._outbox = self._outbox, []
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(deliver, batch)

    def _fail_all(self, error: EngineDeadError) -> None:
        """The loop ended: fail every open and queued request so no client waits forever."""
        with self._lock:
            self._stopping = self._closed = True
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "add":
                    self._pending -= 1
                    self._outbox.append((cmd[1].handle, error))
                elif cmd[0] == "query":
                    self._outbox.append((cmd[2], error))
            self.snapshot = EngineSnapshot.of(self.engine, 0)
        for handle in self._handles.values():
            self._outbox.append((handle, error))
        self._handles.clear()
        self._flush()
