"""Admin safety and graceful shutdown.

- PATCH /controller/config needs the admin key (else the API key) whenever the server listens beyond
  loopback; beyond loopback with neither it is a 403 naming the flag to set; on loopback with no key it
  stays open.
- SIGTERM (what container orchestrators send) drains: new requests get a 503 while the socket still
  answers, the streams in flight finish with all their tokens, and the process exits 0.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from controller.adaptive import AdaptivePolicy
from engine.core.llm_engine import LLMEngine
from engine.model.standin_tokenizer import StandInTokenizer
from engine.serving.app import create_app
from engine.serving.async_engine import AsyncEngine
from engine.serving.context import AppContext, is_loopback
from tests.conftest import start_server
from tests.fake_backend import FakeBackend
from tests.test_server_errors import assert_error

PATCH = {"margin_floor_mib": 20.0}


def admin_client(bind_host: str, api_key: str | None = None, admin_key: str | None = None) -> Iterator[TestClient]:
    engine = AsyncEngine(LLMEngine(FakeBackend(), AdaptivePolicy()))
    ctx = AppContext(engine, "fake", StandInTokenizer(), api_key=api_key, admin_key=admin_key, bind_host=bind_host)
    with TestClient(create_app(ctx)) as client:
        yield client


@pytest.fixture
def exposed_without_keys() -> Iterator[TestClient]:
    yield from admin_client("0.0.0.0")


def test_is_loopback() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "192.168.0.1"))


def test_beyond_loopback_without_keys_the_config_write_is_403(exposed_without_keys: TestClient) -> None:
    c = exposed_without_keys
    error = assert_error(c.patch("/controller/config", json=PATCH), 403, code="admin_key_required")
    assert "--admin-key" in error["message"] and "0.0.0.0" in error["message"]
    state = c.get("/controller/state")  # reading stays open
    assert state.status_code == 200 and state.json()["config"]["margin_floor_mib"] != PATCH["margin_floor_mib"]


def test_loopback_without_keys_stays_open() -> None:
    for c in admin_client("127.0.0.1"):
        r = c.patch("/controller/config", json=PATCH)
        assert r.status_code == 200 and r.json()["config"]["margin_floor_mib"] == PATCH["margin_floor_mib"]
        bad = c.patch("/controller/config", json={"margin_floor_mib": -1})
        assert_error(bad, 400, param="margin_floor_mib", code="invalid_value")


@pytest.mark.parametrize(("api_key", "admin_key", "good"), [(None, "root", "root"), ("user", None, "user"),
                                                            ("user", "root", "root")])  # fmt: skip
def test_beyond_loopback_the_admin_key_or_else_the_api_key_is_required(
    api_key: str | None, admin_key: str | None, good: str
) -> None:
    for c in admin_client("0.0.0.0", api_key=api_key, admin_key=admin_key):
        assert_error(c.patch("/controller/config", json=PATCH), 401, code="invalid_api_key")
        for wrong in {"nope", api_key} - {good, None}:
            r = c.patch("/controller/config", json=PATCH, headers={"Authorization": f"Bearer {wrong}"})
            assert_error(r, 401, code="invalid_api_key")
        r = c.patch("/controller/config", json=PATCH, headers={"Authorization": f"Bearer {good}"})
        assert r.status_code == 200, r.text


# ---- SIGTERM on a real server process -----------------------------------------------------------------

STREAMS = 16
MAX_TOKENS = 96


def stream_usage(url: str, started: threading.Barrier, out: list) -> None:
    """One streamed completion: (finish_reason, completion_tokens) appended to `out`."""
    body = {"prompt": "hello", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    reason, tokens = None, None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            started.wait(60)
            for line in lines:
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                    reason = chunk["choices"][0]["finish_reason"]
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    finally:
        out.append((reason, tokens))


@pytest.mark.timeout(180)
def test_sigterm_drains_open_streams_refuses_new_requests_and_exits_0(tmp_path: Path) -> None:
    server = start_server(("--backend", "twin", "--shutdown-grace", "60"), tmp_path / "server.log")
    try:
        started = threading.Barrier(STREAMS + 1)
        results: list = []
        threads = [threading.Thread(target=stream_usage, args=(server.url, started, results)) for _ in range(STREAMS)]
        for t in threads:
            t.start()
        started.wait(60)  # every stream has its first token
        server.proc.send_signal(signal.SIGTERM)
        new = httpx.post(server.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=30)
        assert_error(new, 503)
        assert_error(httpx.get(server.url + "/health", timeout=30), 503, code="shutting_down")
        for t in threads:
            t.join(120)
        assert results == [("length", MAX_TOKENS)] * STREAMS, server.log_tail()
        assert server.proc.wait(60) == 0, server.log_tail()
    finally:
        server.stop()
