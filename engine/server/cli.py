"""`headroom serve`: build the engine, wire telemetry, and run the API under uvicorn.

Also runnable as `python -m engine.server.cli [flags]` (same flags), which tests use so they do not depend
on the other subcommands importing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

from engine.factory import add_engine_args, build_backend, build_policy
from engine.llm_engine import LLMEngine
from engine.sequence import Sequence
from engine.server.app import create_app
from engine.server.async_engine import AsyncEngine
from engine.server.context import AppContext, is_loopback
from engine.server.standin import StandInTokenizer
from telemetry.metrics import Metrics, RequestTiming
from telemetry.trace import StepTrace

logger = logging.getLogger("headroom.server")

DEFAULT_MAX_WAITING = 256
TRACE_CAPACITY = 1024  # step records kept in memory for /controller/state
DEFAULT_SHUTDOWN_GRACE_S = 30.0


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000, help="0 picks a free port (the ready line shows it)")
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names requests may use; responses carry the first (default: the model's own name and --model)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require this Bearer token on /v1/* (default: $HEADROOM_API_KEY; unset: no auth)",
    )
    g.add_argument(
        "--admin-key",
        default=None,
        help="require this Bearer token on PATCH /controller/config (default: $HEADROOM_ADMIN_KEY; unset: the "
        "--api-key; with neither, the endpoint is open on loopback and refused beyond it)",
    )
    g.add_argument(
        "--shutdown-grace",
        type=float,
        default=DEFAULT_SHUTDOWN_GRACE_S,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT: stop admitting (503) and let open requests finish this long, then abort them",
    )
    g.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING, help="queued requests before 429")
    g.add_argument("--trace-file", default=None, help="write every step record as a JSON line here")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_engine_args(p, default_policy="adaptive")
    p.set_defaults(realtime=True)  # the twin backend sleeps its modelled step time, so clients see real latency


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API", description=__doc__)
    add_serve_args(p)
    p.set_defaults(func=serve)


def build_app(args: argparse.Namespace) -> Any:
    """The ready-to-run FastAPI app (engine built, telemetry wired, loop not yet started)."""
    if args.max_waiting <= 0:
        raise SystemExit("--max-waiting must be positive")
    if args.shutdown_grace < 0:
        raise SystemExit("--shutdown-grace must not be negative")
    if args.backend == "torch":
        logger.info("loading model %s (device %s, dtype %s)", args.model, args.device, args.dtype)
    else:
        logger.info("loading twin profile %s", args.profile)
    t0 = time.monotonic()
    backend = build_backend(args)
    logger.info(
        "allocated KV cache: %d blocks x %d tokens, max_model_len %d (model %s, %.1f s)",
        backend.num_blocks, backend.block_size, backend.max_model_len, backend.model_name, time.monotonic() - t0,
    )  # fmt: skip
    engine = LLMEngine(backend, build_policy(args))
    names = list(dict.fromkeys(args.served_model_name or [backend.model_name, args.model]))
    name = names[0]
    metrics = Metrics(name, backend.max_model_len)
    trace = StepTrace(TRACE_CAPACITY, path=args.trace_file)

    def observe_finished(seq: Sequence) -> None:
        timing = RequestTiming(
            arrival=seq.arrival_time,
            finished=backend.now(),
            first_scheduled=seq.first_scheduled_time,
            first_token=seq.first_token_time,
            token_times=list(seq.token_times),
        )
        metrics.observe_request_finished(seq.prompt_len, len(seq.output_ids), seq.finish_reason or "abort", timing)

    server = AsyncEngine(
        engine, args.max_waiting, on_step=[metrics.observe_step, trace.append], on_finish=[observe_finished]
    )
    config = getattr(backend, "config", None)
    ctx = AppContext(
        engine=server,
        model_name=name,
        tokenizer=backend.tokenizer or StandInTokenizer(),
        api_key=args.api_key or os.environ.get("HEADROOM_API_KEY") or None,
        metrics=metrics,
        trace=trace,
        vocab_size=getattr(config, "vocab_size", None) or getattr(backend, "vocab_size", None),
        other_names=tuple(names[1:]),
        admin_key=args.admin_key or os.environ.get("HEADROOM_ADMIN_KEY") or None,
        bind_host=args.host,
    )
    if ctx.admin_locked:
        logger.warning(
            "listening on %s, beyond loopback, with no --admin-key or --api-key: PATCH /controller/config "
            "answers 403 (set --admin-key or $HEADROOM_ADMIN_KEY to allow it)",
            args.host,
        )
    elif ctx.api_key is None and not is_loopback(args.host):
        logger.warning("listening on %s, beyond loopback, with no --api-key: /v1/* is open to anyone", args.host)
    logger.info("starting engine loop (policy %s, max waiting %d)", engine.policy.name, args.max_waiting)
    return create_app(ctx)


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


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="[headroom] %(message)s", stream=sys.stderr)
    app = build_app(args)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning" if args.log_level == "info" else args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    try:
        sock = config.bind_socket()
    except (OSError, SystemExit) as e:
        logger.error("cannot listen on %s:%s: %s", args.host, args.port, e)
        return 1
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{port}"
    logger.info("listening on %s", url)
    server = draining_server(config, app.state.ctx.engine, args.shutdown_grace)

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(f"Headroom ready at {url}", flush=True)
        await task

    asyncio.run(run())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="headroom serve", description=__doc__)
    add_serve_args(p)
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
