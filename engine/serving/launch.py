"""Run the API server from an EngineConfig and a ServerConfig: build the engine, wire telemetry, serve under
uvicorn, and drain on SIGTERM. The CLI (engine/serving/cli.py) and any other launcher build the configs."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from types import FrameType
from typing import Any

from fastapi import FastAPI

from engine.config import EngineConfig, ServerConfig
from engine.core.kv.sizing import StartupProfilingError
from engine.core.llm_engine import LLMEngine
from engine.core.stats import FinishedRequest
from engine.factory import build_engine
from engine.model.families import UnsupportedModelError
from engine.model.standin_tokenizer import StandInTokenizer
from engine.model.tensor_parallel import TensorParallelError
from engine.serving.app import create_app
from engine.serving.async_engine import AsyncEngine
from engine.serving.context import AppContext, is_loopback
from telemetry.metrics import Metrics, RequestTiming
from telemetry.trace import StepTrace

logger = logging.getLogger("headroom.server")

TRACE_CAPACITY = 1024  # step records kept in memory for /controller/state


def build_app(ecfg: EngineConfig, scfg: ServerConfig) -> FastAPI:
    """The ready-to-run FastAPI app (engine built, telemetry wired, loop not yet started)."""
    engine = _load_engine(ecfg)
    backend = engine.backend
    names = list(dict.fromkeys(scfg.served_model_name or [backend.model_name, ecfg.model]))
    metrics = Metrics(names[0], backend.max_model_len)
    trace = StepTrace(TRACE_CAPACITY, path=scfg.trace_file)
    tokenizer = backend.tokenizer or StandInTokenizer()

    def warm_up() -> None:
        logger.info("warm-up on the engine thread: %.2f s", backend.warm_up())

    server = AsyncEngine(
        engine,
        scfg.max_waiting,
        on_step=[metrics.observe_step, trace.append],
        on_finish=[lambda request: _observe_finished(metrics, backend.now(), request)],
        warm_up=warm_up if ecfg.backend == "torch" else None,
        tokenizer=tokenizer,
    )
    ctx = AppContext(
        engine=server,
        model_name=names[0],
        tokenizer=tokenizer,
        api_key=scfg.api_key,
        metrics=metrics,
        trace=trace,
        vocab_size=backend.vocab_size,
        other_names=tuple(names[1:]),
        admin_key=scfg.admin_key,
        bind_host=scfg.host,
        plant=backend.info().as_dict(),
        tool_call_parser=scfg.tool_call_parser,
        trust_request_chat_template=scfg.trust_request_chat_template,
    )
    _warn_if_exposed(ctx, scfg.host)
    logger.info("starting engine loop (policy %s, max waiting %d)", engine.policy.name, scfg.max_waiting)
    return create_app(ctx)


def _load_engine(ecfg: EngineConfig) -> LLMEngine:
    """Build the engine (sizing the KV pool where the controller owns it) and log what it chose."""
    if ecfg.backend == "torch":
        logger.info("loading model %s (device %s, dtype %s)", ecfg.model, ecfg.device, ecfg.dtype)
    else:
        logger.info("loading twin profile %s", ecfg.profile)
    t0 = time.monotonic()
    engine = build_engine(ecfg)
    backend = engine.backend
    for what, choice in backend.info().as_dict().items():
        logger.info("%s: %s", what, choice)
    logger.info(
        "allocated KV cache: %d blocks x %d tokens, max_model_len %d (model %s, %.1f s)",
        backend.num_blocks, backend.block_size, backend.max_model_len, backend.model_name, time.monotonic() - t0,
    )  # fmt: skip
    return engine


def _observe_finished(metrics: Metrics, now: float, request: FinishedRequest) -> None:
    """A finished request's histograms (on the engine thread, from its finish listener)."""
    timing = RequestTiming(
        arrival=request.arrival_time,
        finished=now,
        first_scheduled=request.first_scheduled_time,
        first_token=request.first_token_time,
        token_times=list(request.token_times),
    )
    metrics.observe_request_finished(request.prompt_len, len(request.output_ids), request.finish_reason, timing)


def _warn_if_exposed(ctx: AppContext, host: str) -> None:
    if ctx.admin_locked:
        logger.warning(
            "listening on %s, beyond loopback, with no --admin-key or --api-key: PATCH /controller/config "
            "answers 403 (set --admin-key or $HEADROOM_ADMIN_KEY to allow it)",
            host,
        )
    elif ctx.api_key is None and not is_loopback(host):
        logger.warning("listening on %s, beyond loopback, with no --api-key: /v1/* is open to anyone", host)


def draining_server(config: Any, engine: AsyncEngine, grace: float) -> Any:
    """A uvicorn.Server whose first SIGTERM or SIGINT drains instead of stopping at once: new requests get
    503 while the socket still answers, open ones finish (aborted after `grace` seconds), then uvicorn
    shuts down. The signal is not re-raised afterwards, so a drained server exits 0 (uvicorn re-raises
    it, and the process ends with 143). A second signal stops at once."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        draining: asyncio.Task[None] | None = None

        async def serve(self, sockets: list[Any] | None = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets=sockets)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            """Runs in a signal handler: only hand the drain to the event loop (thread-safe wake-up)."""
            if self.draining is not None or self.loop is None:
                self.force_exit = self.should_exit
                self.should_exit = True
                return
            logger.info("%s: draining (grace %.0f s)", signal.Signals(sig).name, grace)
            self.loop.call_soon_threadsafe(self.start_drain)

        def start_drain(self) -> None:
            if self.draining is None:
                self.draining = asyncio.get_running_loop().create_task(self.drain())

        async def drain(self) -> None:
            aborted = await engine.drain(grace)
            if aborted:
                logger.warning("aborted %d requests still open after the %.0f s grace period", aborted, grace)
            self.should_exit = True

    return DrainingServer(config)


def serve(ecfg: EngineConfig, scfg: ServerConfig) -> int:
    """Build the app and serve it until a signal drains it; 0 after a clean drain, 1 if it cannot listen."""
    import uvicorn

    logging.basicConfig(level=scfg.log_level.upper(), format="[headroom] %(levelname)s %(message)s", stream=sys.stderr)
    try:
        app = build_app(ecfg, scfg)
    except (StartupProfilingError, TensorParallelError, UnsupportedModelError) as e:  # a message, not a traceback
        logger.error("%s", e)
        return 1
    config = uvicorn.Config(
        app,
        host=scfg.host,
        port=scfg.port,
        log_level="warning" if scfg.log_level == "info" else scfg.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    try:
        sock = config.bind_socket()
    except (OSError, SystemExit) as e:
        logger.error("cannot listen on %s:%s: %s", scfg.host, scfg.port, e)
        return 1
    port = sock.getsockname()[1]
    host = f"[{scfg.host}]" if ":" in scfg.host else scfg.host
    url = f"http://{host}:{port}"
    logger.info("listening on %s", url)
    server = draining_server(config, app.state.ctx.engine, scfg.shutdown_grace)

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(f"Headroom ready at {url}", flush=True)
        await task

    asyncio.run(run())
    return 0
