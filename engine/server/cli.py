"""`headroom serve`: build the engine, wire telemetry, and run the API under uvicorn.

Also runnable as `python -m engine.server.cli [flags]` (same flags), which tests use so they do not depend
on the other subcommands importing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from typing import Any

from engine.factory import add_engine_args, build_backend, build_policy
from engine.llm_engine import LLMEngine
from engine.sequence import Sequence
from engine.server.app import create_app
from engine.server.async_engine import AsyncEngine
from engine.server.context import AppContext
from engine.server.standin import StandInTokenizer
from telemetry.metrics import Metrics, RequestTiming
from telemetry.trace import StepTrace

logger = logging.getLogger("headroom.server")

DEFAULT_MAX_WAITING = 256
TRACE_CAPACITY = 1024  # step records kept in memory for /controller/state


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000, help="0 picks a free port (the ready line shows it)")
    g.add_argument("--served-model-name", default=None, help="name in /v1/models (default: the model's)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require this Bearer token on /v1/* (default: $HEADROOM_API_KEY; unset: no auth)",
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
    if args.backend == "torch":
        logger.info("loading model %s (device %s, dtype %s)", args.model, args.device, args.dtype)
    else:
        logger.info("loading twin profile %s", args.profile)
    t0 = time.monotonic()
    backend = build_backend(args)
    if args.backend == "torch":
        logger.info("dtype %s (%s)", str(backend.dtype).removeprefix("torch."), backend.dtype_reason)
    logger.info(
        "allocated KV cache: %d blocks x %d tokens, max_model_len %d (model %s, %.1f s)",
        backend.num_blocks, backend.block_size, backend.max_model_len, backend.model_name, time.monotonic() - t0,
    )  # fmt: skip
    engine = LLMEngine(backend, build_policy(args))
    name = args.served_model_name or backend.model_name
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
        vocab_size=getattr(config, "vocab_size", None),
    )
    logger.info("starting engine loop (policy %s, max waiting %d)", engine.policy.name, args.max_waiting)
    return create_app(ctx)


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
    server = uvicorn.Server(config)

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
