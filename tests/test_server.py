"""`headroom serve` end to end: the real server (default model, CPU) driven by the official openai client.

The shared server runs in float32 (tests/conftest.py) for speed: this CPU has no native bf16. The
continuous-batching test needs batch-invariant greedy rows (each of 16 concurrent streams must produce
exactly the text it produces alone); that holds in float32 and, checked with HEADROOM_TEST_DTYPE=bfloat16,
in bf16 on this CPU too.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from engine.model.standin_tokenizer import StandInTokenizer
from telemetry.phases import PHASES

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = [  # different lengths, so batched rows have different contexts
    "Tell me a story about a dragon.",
    "What is 2+2?",
    "Name three colors of the rainbow and explain why the sky is blue.",
    "Write a haiku about the sea.",
]


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`, from GET /metrics."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r"([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m and m.group(1) == name and all(f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
            total += float(m.group(3))
    return total


def stream_text(stream) -> tuple[str, object]:  # noqa: ANN001
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            choice = chunk.choices[0]
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            parts.append(piece or "")
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(parts), usage


# ---- the real server -------------------------------------------------------------------------------


def test_models_health_version(server, model_name) -> None:  # noqa: ANN001
    assert model_name.startswith("SmolLM2-135M-Instruct")
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    info = httpx.get(server.url + "/version", timeout=10).json()
    assert info["model"] == model_name and info["version"]


def test_chat_greedy_stream_and_usage(client, model_name, tokenizer) -> None:  # noqa: ANN001
    kw = {"model": model_name, "messages": CAPITAL, "temperature": 0, "max_tokens": 24}
    full = client.chat.completions.create(**kw)
    text = full.choices[0].message.content
    assert "Paris" in text

    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    streamed, usage = stream_text(stream)
    assert streamed == text
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(CAPITAL, add_generation_prompt=True))
    assert usage.prompt_tokens == full.usage.prompt_tokens == len(prompt_ids)
    assert usage.completion_tokens == full.usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_n_samples_use_seed_plus_j_and_the_model_flag_is_a_served_name(client, model_name) -> None:  # noqa: ANN001
    """vLLM's parallel sampling: with `seed`, sample j of n samples as a lone request with seed + j does."""
    kw = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    both = client.completions.create(model="default", n=2, seed=7, **kw)
    assert both.model == "default" and [c.index for c in both.choices] == [0, 1]  # the name asked for
    alone = [client.completions.create(model=model_name, seed=s, **kw).choices[0].text for s in (7, 8)]
    assert [c.text for c in both.choices] == alone and alone[0] != alone[1]
    assert both.usage.completion_tokens == 12


def test_completions_ignore_eos_gives_exactly_max_tokens(client, model_name, tokenizer) -> None:  # noqa: ANN001
    kw = {"model": model_name, "max_tokens": 7, "temperature": 0, "extra_body": {"ignore_eos": True}}
    r = client.completions.create(prompt="The quick brown fox", **kw)
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode("The quick brown fox"))
    # the same prompt as token ids gives the same answer
    by_ids = client.completions.create(prompt=tokenizer.encode("The quick brown fox"), **kw)
    assert by_ids.choices[0].text == r.choices[0].text
    # and streaming concatenates to it
    streamed, usage = stream_text(
        client.completions.create(
            prompt="The quick brown fox", stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    assert streamed == r.choices[0].text and usage.completion_tokens == 7


def test_stop_string_cuts_text_also_when_streaming(client, model_name) -> None:  # noqa: ANN001
    kw = {"model": model_name, "prompt": "My favourite animals are", "temperature": 0, "max_tokens": 16}
    full = client.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0].text
    assert len(full) > 12, full
    stop = full[len(full) // 2 : len(full) // 2 + 4]  # likely spans a token boundary
    expected = full[: full.find(stop)]
    cut = client.completions.create(stop=[stop], extra_body={"ignore_eos": True}, **kw)
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    streamed, _ = stream_text(
        client.completions.create(stop=[stop], stream=True, extra_body={"ignore_eos": True}, **kw)
    )
    assert streamed == expected


@pytest.mark.timeout(600)
def test_concurrent_streams_match_their_solo_greedy_text(server, model_name) -> None:  # noqa: ANN001
    openai = pytest.importorskip("openai")
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)

    def kw(prompt: str) -> dict:
        messages = [{"role": "user", "content": prompt}]
        return {"model": model_name, "messages": messages, "temperature": 0, "max_tokens": 10}

    async def solo(prompt: str) -> str:
        return (await aclient.chat.completions.create(**kw(prompt))).choices[0].message.content

    async def streamed(prompt: str) -> str:
        parts = []
        async for chunk in await aclient.chat.completions.create(stream=True, **kw(prompt)):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts)

    async def run() -> tuple[list[str], list[str]]:
        alone = [await solo(p) for p in PROMPTS]
        together = await asyncio.gather(*(streamed(PROMPTS[i % len(PROMPTS)]) for i in range(16)))
        return alone, together

    alone, together = asyncio.run(run())
    assert together == [alone[i % len(PROMPTS)] for i in range(16)]
    assert metric(server.url, "vllm:num_requests_running") == 0


def test_disconnect_mid_stream_aborts_and_frees_kv(server) -> None:  # noqa: ANN001
    aborted = metric(server.url, "vllm:request_success_total", finished_reason="abort")
    body = {"prompt": "Count slowly: one, two,", "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=120) as h, h.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data:")
            if chunks == 3:
                break  # leaving the block closes the connection mid-stream
    wait_idle(server.url)
    assert metric(server.url, "headroom_kv_blocks_used") == 0
    assert metric(server.url, "vllm:request_success_total", finished_reason="abort") == aborted + 1


def wait_idle(url: str, timeout: float = 60) -> dict:
    """Wait until no sequence runs and no KV block is held; returns the engine counters."""
    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(url + "/controller/state", timeout=30).json()["engine"]
        if state["kv_blocks_used"] == 0 and state["num_running"] == 0 and state["num_waiting"] == 0:
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.2)


def test_disconnect_while_waiting_for_a_non_streaming_answer_aborts(server) -> None:  # noqa: ANN001
    aborted = metric(server.url, "vllm:request_success_total", finished_reason="abort")
    # enough tokens that the answer outlasts the 2 s read timeout however fast a step is
    body = {"prompt": "Count slowly: one, two,", "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 2 s and closes the connection
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=2))
    wait_idle(server.url)
    assert metric(server.url, "vllm:request_success_total", finished_reason="abort") == aborted + 1


def test_prefix_cache_hits_are_counted_in_tokens_and_change_no_token(server, client, model_name) -> None:  # noqa: ANN001
    """The same prompt twice: the second takes its full 16-token blocks from the cache but the last token's,
    answers the same, and /metrics and /controller/state count it as vLLM does, in tokens."""
    prompt = "Prefix cache check: " + " ".join(f"item{i}" for i in range(30))
    names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    before = [metric(server.url, name) for name in names]
    kw = {"model": model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    first, second = (client.completions.create(**kw) for _ in range(2))
    n = first.usage.prompt_tokens
    assert second.choices[0].text == first.choices[0].text
    queries, hits = (metric(server.url, name) - b for name, b in zip(names, before, strict=True))
    assert (queries, hits) == (2 * n, (n - 1) // 16 * 16)
    engine = httpx.get(server.url + "/controller/state", timeout=30).json()["engine"]
    assert 0 < engine["prefix_cache_hit_rate"] == engine["prefix_cache_hits"] / engine["prefix_cache_queries"]


def test_metrics_and_controller_endpoints(server) -> None:  # noqa: ANN001
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    for name in ("vllm:num_requests_running", "vllm:time_to_first_token_seconds_bucket", "headroom_kv_blocks_used"):
        assert name in r.text
    state = httpx.get(server.url + "/controller/state", params={"steps": 3}, timeout=30).json()
    assert state["policy"] in ("adaptive", "fixed") and "limits" in state
    assert state["engine"]["kv_blocks_total"] > 0 and state["engine"]["ooms_recovered"] == 0
    assert len(state["recent_steps"]) <= 3
    # the plant's start-up choices, each with its reason: a slower fallback shows here, not only in the log
    plant = state["plant"]
    assert set(plant) == {"dtype", "quantization", "attention", "kv_pool"}
    assert plant["kv_pool"] == "tensors copied on a resize (not a CUDA device)"
    # the per-step breakdown: every phase is there, the forward took time, and /metrics carries it
    phases = state["engine"]["step_phases_s"]
    assert set(phases) == set(PHASES) and phases["forward"] > 0 and min(phases.values()) >= 0
    assert "headroom_step_phase_seconds_total{model_name=" in httpx.get(server.url + "/metrics", timeout=30).text
    # a bad patch is a 400 in OpenAI's shape and changes nothing
    bad = httpx.patch(server.url + "/controller/config", json={"no_such_gain": 1}, timeout=30)
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    after = httpx.get(server.url + "/controller/state", timeout=30).json()
    assert after.get("config") == state.get("config") and after["limits"] == state["limits"]
    if state["policy"] == "adaptive":  # re-applying the current value is accepted
        key = "headroom_frac"
        ok = httpx.patch(server.url + "/controller/config", json={key: state["config"][key]}, timeout=30)
        assert ok.status_code == 200, ok.text


def test_headroom_serve_is_registered_with_every_engine_flag() -> None:
    from engine.serving.cli import configs
    from headroom.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--backend", "twin", "--port", "0", "--max-waiting", "3"])
    ecfg, scfg = configs(parser, args)
    assert scfg.max_waiting == 3 and scfg.port == 0 and ecfg.backend == "twin"
    assert ecfg.policy == "adaptive" and ecfg.realtime
    assert scfg.served_model_name == () and ecfg.num_blocks is None


def test_standin_tokenizer_is_deterministic() -> None:
    tok = StandInTokenizer()
    assert tok.encode("abcdefghi") == tok.encode("abcdefghi") and len(tok.encode("abcdefghi")) == 3
    assert tok.decode([1, 2, 3]) == " the the the"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|assistant|>\n")
