"""`headroom serve --model default --tensor-parallel-size 3` (9 query heads, 3 KV heads: one KV head a rank)
answers the openai client greedily as one process does with the same float weights, and shows every rank on
/metrics and /controller/state; a size that does not divide the heads is refused at start-up."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Callable

import pytest

from tests.conftest import DEFAULT_FLAGS, ServerProcess, default_model_installed

pytestmark = pytest.mark.skipif(not default_model_installed(), reason="the default model is not installed")
openai = pytest.importorskip("openai")

# Under tensor parallelism the weights are float (engine/model/tensor_parallel.py shards float matrices), so
# the one-process reference serves the same float weights.
FLOAT = ("--model", "default", *DEFAULT_FLAGS, "--num-blocks", "256", "--quantization", "none")
QUESTIONS = ["What is the capital of France?", "Count from 1 to 10."]


def answers(server: ServerProcess) -> list[str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    replies = [
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": q}], max_tokens=12, temperature=0
        )
        for q in QUESTIONS
    ]
    return [r.choices[0].message.content for r in replies]


def get(server: ServerProcess, path: str) -> str:
    with urllib.request.urlopen(server.url + path, timeout=30) as reply:
        return reply.read().decode()


def test_tp3_serves_the_default_model_as_one_process_does(server_factory: Callable[..., ServerProcess]) -> None:
    tp3 = server_factory(*FLOAT[:-2], "--tensor-parallel-size", "3")
    got = answers(tp3)
    assert got == answers(server_factory(*FLOAT))
    assert "Paris" in got[0]
    metrics = get(tp3, "/metrics")
    for metric in ("headroom_rank_kv_blocks", "headroom_rank_step_peak_bytes", "headroom_rank_idle_bytes"):
        assert sorted(re.findall(rf'^{metric}{{model_name="[^"]+",rank="(\d)"}} ', metrics, re.M)) == ["0", "1", "2"]
    state = json.loads(get(tp3, "/controller/state"))
    assert [r["rank"] for r in state["ranks"]] == [0, 1, 2]


def test_a_size_that_does_not_divide_the_heads_is_refused_at_start_up() -> None:
    cmd = [sys.executable, "-m", "engine.serving.cli", "--port", "0", *DEFAULT_FLAGS, "--tensor-parallel-size", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 1
    assert "--tensor-parallel-size 2 does not divide the model's 9 attention heads" in done.stderr
    assert "Traceback" not in done.stderr
