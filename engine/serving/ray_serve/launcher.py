"""`headroom serve --replicas N` / `--ray-address ADDR`: start (or join) Ray, deploy the fleet, print the ready
line, and on SIGTERM or SIGINT shut the application down (Serve drains each replica for `shutdown_grace`)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from engine.config import EngineConfig, ServerConfig
from engine.serving.ray_serve.ingress import Ingress
from engine.serving.ray_serve.metrics_board import BOARD_NAME, NAMESPACE
from engine.serving.ray_serve.replica import EngineReplica
from engine.serving.ray_serve.router import HeadroomRouter

logger = logging.getLogger("headroom.ray")

APP_NAME = "headroom"
STATS_PERIOD_S = 0.5  # how often each replica's routing stats are polled (the ledger covers the gap)
TWIN_REPLICA_CPUS = 0.25  # the twin computes nothing: several replicas share a core
TORCH_REPLICA_CPUS = 1.0


def replica_resources(ecfg: EngineConfig) -> dict[str, float]:
    """One GPU per rank on CUDA (a replica is one tensor-parallel group, its ranks in the replica's actor and
    the processes it spawns); CPU shares for the twin and the CPU."""
    if ecfg.backend == "twin":
        return {"num_cpus": TWIN_REPLICA_CPUS}
    gpus = ecfg.tensor_parallel_size
    if ecfg.device.startswith("cuda"):
        return {"num_cpus": TORCH_REPLICA_CPUS, "num_gpus": gpus}
    if ecfg.device == "auto":
        import torch

        return {"num_cpus": TORCH_REPLICA_CPUS, "num_gpus": gpus if torch.cuda.is_available() else 0}
    return {"num_cpus": TORCH_REPLICA_CPUS}


def fleet_app(ecfg: EngineConfig, scfg: ServerConfig) -> Any:
    """The bound Serve application: the ingress over `scfg.replicas` engine replicas."""
    routing: dict[str, Any] = {}  # Ray's default router unless the headroom one is asked for
    if scfg.router == "headroom":
        routing["request_router_config"] = RequestRouterConfig(
            request_router_class=HeadroomRouter,
            request_routing_stats_period_s=STATS_PERIOD_S,
            request_routing_stats_timeout_s=5 * STATS_PERIOD_S,
        )
    per_replica = 2 * scfg.max_waiting  # waiting plus running: the engine's own 429 bounds the queue
    engine = serve.deployment(EngineReplica).options(
        name="engine",
        num_replicas=scfg.replicas,
        max_ongoing_requests=per_replica,
        ray_actor_options=replica_resources(ecfg),
        **routing,
        graceful_shutdown_timeout_s=scfg.shutdown_grace,
    )
    ingress = serve.deployment(Ingress).options(
        name="ingress", max_ongoing_requests=per_replica * scfg.replicas, ray_actor_options={"num_cpus": 0}
    )
    return ingress.bind(engine.bind(ecfg.to_json(), scfg.to_json()), scfg.max_resends)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start(ecfg: EngineConfig, scfg: ServerConfig) -> str:
    """Start or join Ray and deploy; returns the app's URL once every replica is up."""
    local_cpus = None if scfg.ray_address else max(os.cpu_count() or 1, 1)
    ray.init(
        address=scfg.ray_address, num_cpus=local_cpus, include_dashboard=False, namespace=NAMESPACE,
        logging_level=scfg.log_level.upper(), ignore_reinit_error=True,
    )  # fmt: skip
    port = scfg.port or free_port(scfg.host)
    serve.start(http_options={"host": scfg.host, "port": port}, proxy_location="HeadOnly")
    serve.run(fleet_app(ecfg, scfg), name=APP_NAME, route_prefix="/")
    host = f"[{scfg.host}]" if ":" in scfg.host else scfg.host
    return f"http://{host}:{port}"


def stop(local: bool) -> None:
    """Delete the application (replicas drain) and the metrics board; a local Ray goes down with Serve, a
    joined cluster keeps both running."""
    serve.delete(APP_NAME)
    with contextlib.suppress(ValueError):  # never created
        ray.kill(ray.get_actor(BOARD_NAME, namespace=NAMESPACE))
    if local:
        serve.shutdown()
    ray.shutdown()


def serve_fleet(ecfg: EngineConfig, scfg: ServerConfig) -> int:
    """Serve until SIGTERM or SIGINT, then shut down; 0 after a clean stop."""
    logging.basicConfig(level=scfg.log_level.upper(), format="[headroom] %(levelname)s %(message)s", stream=sys.stderr)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    url = start(ecfg, scfg)
    print(f"Headroom ready at {url} ({scfg.replicas} replicas, router {scfg.router})", flush=True)
    stopping.wait()
    logger.info("stopping the fleet (grace %.0f s)", scfg.shutdown_grace)
    stop(local=scfg.ray_address is None)
    return 0
