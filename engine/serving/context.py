"""What every route reads: the engine thread's handle and the server's wiring, kept on `app.state`.

Routes are plain module-level functions that take the context through `Depends(context)`, so each concern
(OpenAI API, controller, health and metrics) lives in its own module without closures over `create_app`.
Routes read the engine only through `AsyncEngine` (its snapshot and queries), never its objects directly:
the engine thread owns them.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from engine.serving.async_engine import AsyncEngine
from engine.serving.errors import APIError
from telemetry.metrics import Metrics
from telemetry.trace import StepTrace


@dataclass
class AppContext:
    engine: AsyncEngine
    model_name: str  # the first served name: responses carry it
    tokenizer: Any  # the backend's, or engine.model.standin_tokenizer.StandInTokenizer for the twin
    api_key: str | None = None
    metrics: Metrics | None = None
    trace: StepTrace | None = None
    vocab_size: int | None = None  # token ids in prompts must be below it (None: unchecked)
    other_names: tuple[str, ...] = ()  # further names a request may use for the model (/v1/models lists all)
    admin_key: str | None = None  # guards PATCH /controller/config (None: the api_key does)
    bind_host: str = "127.0.0.1"  # where the server listens: beyond loopback the admin endpoint needs a key
    plant: dict[str, str] = field(default_factory=dict)  # the backend's start-up choices and why (launch.py)
    tool_call_parser: str | None = None  # --tool-call-parser: how tool_choice auto finds calls in the text
    trust_request_chat_template: bool = False  # --trust-request-chat-template: a request may bring its own

    @property
    def admin_token(self) -> str | None:
        return self.admin_key or self.api_key

    @property
    def admin_locked(self) -> bool:
        """Reachable beyond loopback with no key to guard the controller's write endpoint: refuse writes."""
        return self.admin_token is None and not is_loopback(self.bind_host)

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.other_names)


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback address ("0.0.0.0" and "::" are not)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def context(request: Request) -> AppContext:
    return request.app.state.ctx


Ctx = Annotated[AppContext, Depends(context)]


def engine_counters(ctx: AppContext) -> dict[str, Any]:
    """The engine's counters from its last published snapshot (never from the engine's own objects)."""
    engine = ctx.engine
    counters = asdict(engine.snapshot.stats)
    counters.update(
        healthy=engine.healthy,
        num_waiting=engine.num_waiting(),
        max_waiting=engine.max_waiting,
        draining=engine.draining,
        prefix_cache_hit_rate=counters["prefix_cache_hits"] / max(1, counters["prefix_cache_queries"]),
        step_phases_s=engine.phase_totals(),
    )
    return counters


def _check_bearer(request: Request, key: str, what: str) -> None:
    header = request.headers.get("authorization", "")
    token = header[7:] if header[:7].lower() == "bearer " else ""
    if not secrets.compare_digest(token.encode(), key.encode()):
        raise APIError(401, f"invalid or missing {what} (send Authorization: Bearer <key>)", code="invalid_api_key")


def require_key(request: Request) -> None:
    key = context(request).api_key
    if key is not None:
        _check_bearer(request, key, "API key")


def require_admin(request: Request) -> None:
    """The controller's write endpoint: the admin key, else the API key; with neither, open on loopback
    only (anyone who can reach the port could otherwise retune the controller)."""
    ctx = context(request)
    if ctx.admin_locked:
        raise APIError(
            403,
            f"the server listens on {ctx.bind_host}, beyond loopback, without a key: controller config changes "
            "are refused. Start it with --admin-key (or $HEADROOM_ADMIN_KEY), or --api-key",
            code="admin_key_required",
        )
    key = ctx.admin_token
    if key is not None:
        _check_bearer(request, key, "admin key" if ctx.admin_key else "API key")
