"""vLLM's prompt logprobs and echo, exact: every prompt token's logprob (and its rank and top k) is the
log-softmax of a forward pass of the model over the whole text, checked against a direct forward of the model.

In the engine (tiny random Llama): prompts chunked across steps, preempted and recomputed, batched with
requests that do not ask, one prompt cached by an earlier request (a prompt-logprobs request reads nothing
from the prefix cache, as in vLLM). Through the real server (the default model): completions' echo with
logprobs, streamed and not, echo with max_tokens 0 (scoring a prompt), chat's prompt_logprobs."""

from __future__ import annotations

import httpx
import pytest
import torch

from engine.backends.torch_backend import TorchBackend
from engine.baselines.seed import FixedPolicy
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.model.attention import build_attention_metadata
from tests.fixtures_llama import build_tiny_llama

CAPITAL = "The capital of France is"


def forward_logprobs(backend: TorchBackend, ids: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits at every position of `ids`, one direct forward (KV in the pool's first
    blocks: call it on a backend no engine is using)."""
    n, bs = len(ids), backend.block_size
    assert n <= backend.num_blocks * bs, "the pool must hold the text"
    meta = build_attention_metadata([(0, n, list(range(-(-n // bs))))], bs, backend.device, backend.attention)
    with torch.inference_mode():
        hidden = backend.model(torch.tensor(ids), torch.arange(n), backend.kv_caches, meta)
        return torch.log_softmax(backend.model.compute_logits(hidden), dim=-1)


def assert_scores_prompt(entries: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """entries[p] (a TokenLogprob, or None for p = 0) scores ids[p] as the reference forward does."""
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        e, row = entries[p], ref[p - 1]
        assert e.logprob == pytest.approx(row[ids[p]].item(), abs=2e-4), p
        assert e.rank == int((row >= row[ids[p]]).sum())
        assert [t for t, _ in e.top] == row.topk(k).indices.tolist()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny")).hf_dir)


@pytest.fixture(scope="module")
def tiny_backend(tiny_dir: str) -> TorchBackend:
    return TorchBackend(tiny_dir, dtype="float32", device="cpu", num_blocks=12)


def test_prompt_logprobs_are_a_forward_over_the_prompt_chunked_preempted_and_cached(tiny_dir, tiny_backend) -> None:  # noqa: ANN001
    """Four prompts in a pool so small the engine preempts, with prefills chunked 16 tokens a step: each scores
    its prompt exactly as one forward does. A request for a prompt an earlier one left in the prefix cache
    still scores all of it."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (37, 5, 50, 23)]
    ref = TorchBackend(tiny_dir, dtype="float32", device="cpu", num_blocks=16)
    refs = [forward_logprobs(ref, ids) for ids in prompts]
    engine = LLMEngine(tiny_backend, FixedPolicy(max_prefill_tokens=16, kv_reserve_ratio=0.0))
    asking = SamplingParams(max_tokens=24, prompt_logprobs=3, ignore_eos=True, temperature=0)
    quiet = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0)
    seqs = [engine.add_request(str(i), ids, asking if i % 2 == 0 else quiet) for i, ids in enumerate(prompts)]
    firsts = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in firsts and out.prompt_token_ids == tuple(prompts[int(out.request_id)])
                firsts[out.request_id] = out.prompt_logprobs
    assert engine.scheduler.num_preemptions > 0
    assert sorted(firsts) == ["0", "2"] and seqs[1].prompt_logprobs == []
    for i in (0, 2):
        assert_scores_prompt(firsts[str(i)], prompts[i], refs[i], 3)
    cached = engine.add_request("again", prompts[2], asking)  # prompts[2]'s full blocks are cached by now
    while engine.has_unfinished():
        engine.step()
    assert_scores_prompt(cached.prompt_logprobs, prompts[2], refs[2], 3)


def test_requests_that_do_not_ask_compute_logits_for_their_sampled_rows_only(tiny_backend, monkeypatch) -> None:  # noqa: ANN001
    rows = []
    real = tiny_backend.model.compute_logits
    monkeypatch.setattr(tiny_backend.model, "compute_logits", lambda h: rows.append(h.shape[0]) or real(h))
    engine = LLMEngine(tiny_backend, FixedPolicy())
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=2))
    engine.add_request("b", list(range(5, 30)), SamplingParams(max_tokens=2, prompt_logprobs=0))
    while engine.has_unfinished():
        engine.step()
    assert rows == [2, 24, 2]  # the two first tokens, then b's 24 prompt rows; then the two second tokens


# ---- through the real server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> TorchBackend:
    """The default model in this process, as the shared server runs it (float32), for direct forwards."""
    from tests.conftest import default_model_installed

    if not default_model_installed():
        pytest.skip("the default model is not installed")
    return TorchBackend("default", dtype="float32", device="cpu", num_blocks=256)


def ids_of(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_echo_with_logprobs_is_a_forward_of_the_whole_text(server, reference) -> None:  # noqa: ANN001
    """Completions' echo: the prompt's text, then the completion; the logprobs of every token of both (the
    first prompt token's null) are a forward over prompt + completion, within float tolerance; streamed, the
    first chunk carries the prompt and its logprobs, and the chunks join to the same answer."""
    body = {"prompt": CAPITAL, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert r["text"].startswith(CAPITAL) and len(r["text"]) > len(CAPITAL)
    lp = r["logprobs"]
    as_ids = httpx.post(server.url + "/v1/completions", json={**body, "return_tokens_as_token_ids": True}, timeout=120)
    ids = ids_of(as_ids.json()["choices"][0]["logprobs"]["tokens"])
    prompt_ids = reference.tokenizer.encode(CAPITAL, add_special_tokens=True)
    assert ids[: len(prompt_ids)] == prompt_ids and len(ids) == len(prompt_ids) + 8
    ref = forward_logprobs(reference, ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([ref[p - 1, ids[p]].item() for p in range(1, len(ids))], abs=1e-3)
    assert "".join(lp["tokens"]) == r["text"] and lp["text_offset"][-1] == len(r["text"]) - len(lp["tokens"][-1])
    assert len(r["prompt_logprobs"]) == len(prompt_ids) and r["prompt_logprobs"][0] is None
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        chunks = [
            c
            for line in s.iter_lines()
            if line.startswith("data: {")
            for c in [httpx.Response(200, content=line[6:]).json()]
        ]
    assert chunks[0]["choices"][0]["text"].startswith(CAPITAL)
    assert "".join(c["choices"][0]["text"] for c in chunks) == r["text"]
    joined = [t for c in chunks for t in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert joined == lp["token_logprobs"]


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, reference) -> None:  # noqa: ANN001
    """vLLM's echo with max_tokens 0 (how a prompt is scored): the answer is the prompt and its logprobs."""
    body = {"prompt": CAPITAL, "max_tokens": 0, "echo": True, "logprobs": 1, "return_tokens_as_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    ids = reference.tokenizer.encode(CAPITAL, add_special_tokens=True)
    assert r["text"] == CAPITAL and ids_of(r["logprobs"]["tokens"]) == ids
    ref = forward_logprobs(reference, ids)
    assert r["logprobs"]["token_logprobs"][1:] == pytest.approx(
        [ref[p - 1, ids[p]].item() for p in range(1, len(ids))], abs=1e-3
    )
    without_echo = httpx.post(server.url + "/v1/completions", json={"prompt": CAPITAL, "max_tokens": 0}, timeout=60)
    assert without_echo.status_code == 400 and without_echo.json()["error"]["param"] == "max_tokens"


def test_chat_prompt_logprobs_and_n(server, reference) -> None:  # noqa: ANN001
    """Chat: `prompt_logprobs` beside the choices, vLLM's shape ({token id: logprob, rank, decoded_token}), for
    a chunked prompt (longer than a CPU prefill step) and n choices; refused when streamed, as vLLM does."""
    long = " ".join(f"word{i}" for i in range(200))
    messages = [{"role": "user", "content": long}]
    body = {"messages": messages, "max_tokens": 2, "prompt_logprobs": 2, "n": 2, "temperature": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300).json()
    tok = reference.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages))
    assert len(ids) > 512 and len(r["choices"]) == 2 and len(r["prompt_logprobs"]) == len(ids)
    ref = forward_logprobs(reference, ids)
    for p in (1, 300, len(ids) - 1):
        scored = r["prompt_logprobs"][p]
        mine = scored[str(ids[p])]
        assert mine["logprob"] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-3)
        assert mine["rank"] == int((ref[p - 1] >= ref[p - 1, ids[p]]).sum())
        assert mine["decoded_token"] == tok.decode([ids[p]], skip_special_tokens=False)
        assert set(scored) == {str(ids[p]), *map(str, ref[p - 1].topk(2).indices.tolist())}
    streamed = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
