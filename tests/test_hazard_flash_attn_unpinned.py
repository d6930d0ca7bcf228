"""Issue #25, hazard 4: flash-attn was unpinned and missing from the GPU image, so on CUDA the server ran the sdpa
path, which copies each sequence's whole context. The `cuda` extra pins a release with paged KV (`block_table`,
flash-attn 2.5.0 on), the Dockerfile's gpu stage installs it and compose's gpu profile builds that stage; an older
flash-attn falls back to sdpa, and the server logs which attention path runs and why."""

from __future__ import annotations

import logging
import re
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from engine.backends.torch_backend import TorchBackend
from engine.config import EngineConfig
from engine.model.kernel_choice import choose_kernel, flash_attn_load_error
from engine.serving import launch

REPO = Path(__file__).resolve().parents[1]
PAGED_KV = (2, 5, 0)


@pytest.fixture(autouse=True)
def flash_attn_imported_afresh() -> Iterator[None]:
    """The import is cached per process; each test puts its own flash_attn (or none) on the path."""
    flash_attn_load_error.cache_clear()
    yield
    flash_attn_load_error.cache_clear()


def cuda_extra_pin() -> str:
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cuda"]
    pins = [m.group(1) for req in extra if (m := re.fullmatch(r"flash-attn==([\w.]+)", req.replace(" ", "")))]
    assert len(pins) == 1, f"the cuda extra must pin flash-attn with ==, got {extra}"
    return pins[0]


def dockerfile_stages() -> dict[str, str]:
    """Stage name -> its instructions."""
    stages: dict[str, str] = {}
    for chunk in re.split(r"^(?=FROM )", (REPO / "Dockerfile").read_text(), flags=re.M)[1:]:
        name = re.match(r"FROM \S+(?: AS (\S+))?", chunk, flags=re.I)
        assert name and name.group(1), f"every stage is named: {chunk.splitlines()[0]}"
        stages[name.group(1).lower()] = chunk
    return stages


def test_the_cuda_extra_pins_a_flash_attn_with_paged_kv() -> None:
    version = tuple(int(n) for n in re.findall(r"\d+", cuda_extra_pin())[:3])
    assert version >= PAGED_KV


def test_the_dockerfile_gpu_stage_installs_the_cuda_extra_at_the_pinned_version() -> None:
    stages = dockerfile_stages()
    assert {"cpu", "gpu"} <= set(stages)
    assert ".[cuda]" in stages["gpu"] and "[cuda]" not in stages["cpu"]
    assert list(stages)[-1] == "gpu", "a plain `docker build .` builds the GPU image, as before"
    built = re.findall(r"ARG FLASH_ATTN_VERSION=(\S+)", "".join(stages.values()))
    assert built == [cuda_extra_pin()], "the flash-attn the Dockerfile compiles is the one the extra pins"


def test_compose_gpu_profile_builds_the_gpu_stage_and_the_others_the_cpu_stage() -> None:
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    builds = {name: svc["build"] for name, svc in services.items() if "build" in svc}
    targets = {name: build.get("target") if isinstance(build, dict) else None for name, build in builds.items()}
    assert targets == {"headroom": "gpu", "headroom-cpu": "cpu", "headroom-twin": "cpu"}


@pytest.mark.parametrize(("installed", "kernel"), [("2.4.2", "sdpa"), ("2.8.3.post2", "flash")])
def test_a_flash_attn_without_paged_kv_falls_back_to_sdpa_and_says_why(
    fake_flash, monkeypatch: pytest.MonkeyPatch, installed: str, kernel: str
) -> None:
    monkeypatch.setattr("engine.model.kernel_choice.importlib.metadata.version", lambda name: installed)
    choice = choose_kernel("auto", None, torch.device("cuda"), torch.bfloat16)
    assert choice.attention == kernel
    if kernel == "sdpa":
        assert choice.block_size == 16 and f"flash-attn {installed} predates paged KV" in choice.reason


def test_the_server_logs_which_attention_path_runs_and_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ModuleNotFoundError
    choice = choose_kernel("auto", None, torch.device("cuda"), torch.bfloat16)  # CUDA without flash-attn
    backend = SimpleNamespace(
        dtype=torch.bfloat16, dtype_reason="auto: bf16 on CUDA", quant_reason="auto: weights dequantized (CUDA)",
        kv_dtype=torch.bfloat16, kv_reason="auto: the model's dtype", attention=choice.attention,
        block_size=choice.block_size, kernel_reason=choice.reason, num_blocks=64, max_model_len=2048, model_name="m",
        kv_layout="tensors copied on a resize (cuda-bindings is not installed)",
    )  # fmt: skip
    backend.info = lambda: TorchBackend.info(backend)  # what the torch backend shows of these choices
    monkeypatch.setattr(launch, "build_engine", lambda cfg: SimpleNamespace(backend=backend))
    with caplog.at_level(logging.INFO, logger="headroom.server"):
        launch._load_engine(EngineConfig(device="cuda"))
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert re.search(r"attention:? sdpa, block size 16 \(auto: sdpa \(flash_attn is not installed", "\n".join(logged))
