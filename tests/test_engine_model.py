"""The real engine on the default model: continuous batching, chunked prefill and preemption must not change
a single greedy token, and every KV block comes back.

Comparing greedy tokens bitwise is only sound where every kernel computes a token's row the same way
whatever else is in the batch: otherwise a near-tie flips (on bf16 oneDNN without padding, "Write a haiku
about the sea." starts with token 2 batched and 198 alone). Attention and the elementwise ops are
batch-invariant by construction on every CPU path (engine/model/cpu_kernels.py, engine/model/attention.py), and so are
the linears on Headroom's kernels (bf16 on AVX512-BF16, fp32 on AVX2, quantized everywhere); other linears are
probed on this CPU (engine/model/batch_invariance.py), and the comparison runs in the first dtype whose linears
pass: the default (`auto`), else bf16 (fp32 on MKL rounds rows by batch size, while torch's own bf16 kernel
keeps rows apart). Where neither passes the tests skip and say what the probe found.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cli import engine_config
from engine.factory import build_engine
from engine.model.batch_invariance import linear_min_rows, linear_row_mismatch
from engine.model.cpu_kernels import linear_unusable_reason
from engine.model.dtype_choice import choose_dtype
from engine.model.loaders import load
from tests.kernel_build import fail_on_broken_build

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Once upon a time, in a land far away, there lived a dragon who loved to read books about "
    "astronomy and the stars. One night, the dragon",
    "def fibonacci(n):",
    "Translate to French: good morning, my friend. How are you today? I hope the weather is nice.",
    "Q: What is 12 times 12?\nA:",
    "The three primary colors are red, " * 6,
]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def kernels_not_broken() -> None:
    """On the CPU the engine runs the C++ kernels: a build that fails with a compiler present fails these
    tests rather than letting them pass on the plain-torch fallback (tests/kernel_build.py)."""
    fail_on_broken_build()


@pytest.fixture(scope="module")
def invariant_dtype() -> str:
    """The first of `auto` and bf16 whose linears the probe finds batch-invariant on this CPU."""
    cpu = torch.device("cpu")
    shapes = load("default").model.linear_shapes()
    findings = []
    for name in ("auto", "bfloat16"):
        dtype = choose_dtype(name, cpu).dtype
        own_kernel = linear_unusable_reason(dtype) is None  # the model runs its linears as the probe does
        mismatch = linear_row_mismatch(shapes, dtype, linear_min_rows(cpu, dtype), cpu_kernel=own_kernel)
        if mismatch is None:
            return name
        findings.append(f"{name}: {mismatch}")
    pytest.skip("no dtype's linears are batch-invariant on this CPU, greedy tokens may differ: " + "; ".join(findings))


@pytest.fixture(scope="module")
def reference(invariant_dtype) -> list[list[int]]:
    llm = LLM("default", num_blocks=64, dtype=invariant_dtype)
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def generate_together(dtype: str, **options: object) -> tuple[list[list[int]], LLM]:
    llm = LLM("default", dtype=dtype, **options)
    outs = llm.generate(PROMPTS, GREEDY)
    return [o.token_ids for o in outs], llm


@pytest.mark.parametrize(
    "options",
    [
        {"num_blocks": 256},
        # vLLM-like: prompt-only reservation, mixed steps, prefill chunked to 32 tokens.
        {
            "num_blocks": 256,
            "kv_reserve_ratio": 0.0,
            "fixed_steps": "mixed",
            "max_num_batched_tokens": 32,
        },
    ],
    ids=["batched", "chunked-32"],
)
def test_batched_greedy_equals_alone(invariant_dtype, reference, options):
    together, llm = generate_together(invariant_dtype, **options)
    assert together == reference
    assert llm.engine.allocator.num_used == 0
    if "max_num_batched_tokens" in options:
        assert llm.engine.scheduler.num_preemptions == 0


def test_preemption_keeps_greedy_tokens(invariant_dtype, reference):
    # 12 blocks of 16 tokens cannot hold 8 prompts of ~10-40 tokens plus growth: decodes preempt by recompute.
    together, llm = generate_together(invariant_dtype, num_blocks=12, kv_reserve_ratio=0.0, fixed_steps="mixed")
    assert llm.engine.scheduler.num_preemptions > 0
    assert together == reference
    assert llm.engine.allocator.num_used == 0


def test_a_warm_up_leaves_no_trace(invariant_dtype, reference):
    """The server's warm-up (TorchBackend.warm_up) writes the first blocks' KV before any request: the
    blocks stay free and every greedy token is the same."""
    llm = LLM("default", num_blocks=64, dtype=invariant_dtype)
    assert llm.engine.backend.warm_up() > 0
    assert llm.engine.allocator.num_used == 0
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_engine_rejects_prompt_longer_than_context():
    engine = build_engine(engine_config(["--max-model-len", "64"]))
    from engine.core.llm_engine import RequestError

    with pytest.raises(RequestError, match="maximum context length"):
        engine.add_request("x", list(range(100)), SamplingParams())


def test_generate_cli_answers_paris():
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "headroom"),
            "generate",
            "--chat",
            "--prompt",
            "What is the capital of France?",
            "--max-tokens",
            "16",
            "--temperature",
            "0",
            "--quantization",  # the dequantized model knows; as shipped (Q4_1), it answers as llama.cpp does
            "none",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "Paris" in out.stdout


def test_kv_pool_resizes_between_steps_keep_greedy_tokens(invariant_dtype, reference):
    """Grow, then shrink with in-use blocks moved down (engine/core/kv/blocks.py), between steps on the real
    model: the KV copied by resize_kv_cache must be exactly what attention reads afterwards."""
    llm = LLM("default", num_blocks=64, dtype=invariant_dtype)
    engine = llm.engine
    seqs = [
        engine.add_request(str(i), llm.tokenizer.encode(p, add_special_tokens=True), GREEDY)
        for i, p in enumerate(PROMPTS)
    ]
    hold = engine.allocator.allocate(40)
    engine.step()  # the prompts take blocks 40 and up
    engine.allocator.free(hold)
    assert engine.resize_kv_pool(128).num_blocks == 128
    sizes, moved = iter((30, 96, 24)), 0
    while engine.has_unfinished():
        engine.step()
        target = next(sizes, None)
        if target is not None:
            plan = engine.resize_kv_pool(target)
            moved += len(plan.moves) if plan else 0
    assert moved > 0
    assert [s.output_ids for s in seqs] == reference
    assert engine.backend.kv_caches[0][0].shape[0] == engine.allocator.num_blocks


def test_prefix_cache_hits_keep_greedy_tokens(invariant_dtype, reference):
    """A repeated prompt and a chat's next turn (the last prompt and answer resent, plus more) start after
    their cached blocks: their greedy tokens are those computed without the cache."""
    llm = LLM("default", num_blocks=64, dtype=invariant_dtype)
    first = llm.generate([PROMPTS[7]], GREEDY)[0]
    follow = first.prompt_token_ids + first.token_ids + llm.tokenizer.encode(" And", add_special_tokens=False)
    warm = [o.token_ids for o in llm.generate([PROMPTS[7], follow], GREEDY)]
    n = len(first.prompt_token_ids)  # the first run computed its prompt and all but its last answer token
    assert llm.engine.prefix_cache.hits == ((n - 1) // 16 + min((n + 11) // 16, (len(follow) - 1) // 16)) * 16
    cold = LLM("default", num_blocks=64, dtype=invariant_dtype, enable_prefix_caching=False)
    assert warm == [reference[7], cold.generate([follow], GREEDY)[0].token_ids]
