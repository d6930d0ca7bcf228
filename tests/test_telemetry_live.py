"""Telemetry end to end: a served engine's /metrics after real requests, and the JSONL step trace against
the engine's own KV allocator."""

from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest

from controller.adaptive import AdaptivePolicy
from engine.backends.twin.backend import TwinBackend
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from telemetry.trace import StepTrace, read_trace
from tests.test_metrics import HEADROOM_NAMES, VLLM_NAMES
from tests.test_server import metric


@pytest.fixture(scope="module")
def twin(twin_server):  # noqa: ANN001, ANN201
    return twin_server()


def test_metrics_after_requests(twin) -> None:  # noqa: ANN001
    url = twin.url
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    prompt_before = metric(url, "vllm:prompt_tokens_total")
    gen_before = metric(url, "vllm:generation_tokens_total")
    ttft_before = metric(url, "vllm:time_to_first_token_seconds_count")
    usage = []
    for n in (5, 40, 300):
        body = {"model": model, "prompt": list(range(1, n + 1)), "max_tokens": 8, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        usage.append(r.json()["usage"])
    text = httpx.get(url + "/metrics", timeout=30).text
    exposed = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
    missing = (VLLM_NAMES | HEADROOM_NAMES) - exposed
    assert not missing, missing
    assert metric(url, "vllm:prompt_tokens_total") - prompt_before == sum(u["prompt_tokens"] for u in usage)
    assert metric(url, "vllm:generation_tokens_total") - gen_before == sum(u["completion_tokens"] for u in usage)
    assert metric(url, "vllm:time_to_first_token_seconds_count") - ttft_before == 3
    assert metric(url, "vllm:e2e_request_latency_seconds_count") >= 3
    assert metric(url, "headroom_step_duration_seconds_count") > 0
    if shutil.which("promtool"):
        result = subprocess.run(["promtool", "check", "metrics"], input=text.encode(), capture_output=True)
        findings = (result.stdout + result.stderr).decode().splitlines()
        assert result.returncode in (0, 3)  # 3: lint findings; only the colon in vLLM's names is allowed
        assert all(f.startswith("vllm:") and "should not contain ':'" in f for f in findings if f.strip())


def test_trace_lines_parse_and_match_the_allocator(tmp_path) -> None:  # noqa: ANN001
    engine = LLMEngine(TwinBackend(num_blocks=64), AdaptivePolicy())
    path = tmp_path / "trace.jsonl"
    held: list[int] = []  # distinct blocks held by running sequences (prefix caching shares them), per record
    with StepTrace(16, path=path) as trace:
        engine.step_listeners.append(lambda record, batch: trace.append(record))
        engine.step_listeners.append(
            lambda record, batch: held.append(len({b for s in engine.scheduler.running for b in s.block_table}))
        )
        for i in range(12):
            engine.add_request(str(i), [7] * (100 + 300 * i), SamplingParams(max_tokens=64, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    lines = read_trace(path)
    assert len(lines) == engine.step_id == len(held) > 12
    assert [line["kv_blocks_used"] for line in lines] == held
    assert all(line["kv_blocks_used"] + line["kv_blocks_free"] == line["kv_blocks_total"] == 64 for line in lines)
    assert engine.allocator.num_used == 0
