"""Quantized weights served as they ship (engine/model/quant.py, engine/model/csrc/qlinear.cpp): the kernel against
its arithmetic, batch invariance, the AVX-512, AVX2 and plain paths giving the same bits, the loader keeping
the default GGUF's blocks, and the `--quantization` choice."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from engine.model import cpu_kernels
from engine.model.quant import KINDS, RawQuant, choose_quantization, pack, packed_shape, quantize
from tests.kernel_build import require_cpu_kernels

SHAPES = [(64, 128), (48, 576), (96, 64)]  # (N, K): 48 leaves a one-block column after the two-block ones


@pytest.fixture(autouse=True)
def kernels_built() -> None:
    require_cpu_kernels()


def weight(n: int, k: int, kind: str, seed: int = 0) -> RawQuant:
    return quantize(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32), kind)


def reference(x: torch.Tensor, raw: RawQuant) -> torch.Tensor:
    """The kernel's arithmetic in float64: x rounded per 32-block to int8 steps of max|x|/127, times the
    dequantized weight."""
    blocks = x.double().view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(blocks * torch.where(d == 0, 0, 1 / d)) * d
    return xq.view_as(x) @ torch.from_numpy(raw.floats()).double().T


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_computes_quantized_rows_times_the_weight(kind: str, dtype: torch.dtype) -> None:
    for n, k in SHAPES:
        raw = weight(n, k, kind)
        x = torch.randn(9, k, generator=torch.Generator().manual_seed(1)).to(dtype)
        y = cpu_kernels.cpu_qlinear(x, pack(raw))
        assert y.dtype == dtype and y.shape == (9, n)
        ref = reference(x, raw)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # fp32 sums; bf16 adds the output's rounding
        assert (y.double() - ref).abs().max() <= tolerance * ref.abs().max()


def test_the_weights_stay_within_their_blocks_rounding() -> None:
    w = np.random.default_rng(2).standard_normal((32, 64)).astype(np.float32)
    for kind, steps in (("q8_0", 127), ("q4_0", 8), ("q4_1", 15)):
        err = np.abs(quantize(w, kind).floats() - w).max()
        assert err <= np.abs(w).max() / steps * 1.01, kind


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_row_is_the_same_alone_and_batched_and_on_the_plain_path(kind: str) -> None:
    packed = pack(weight(64, 576, kind))
    x = torch.randn(67, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    batched = cpu_kernels.cpu_qlinear(x, packed)
    for rows in (1, 2, 3, 5, 8):
        assert torch.equal(cpu_kernels.cpu_qlinear(x[:rows], packed), batched[:rows])
    assert torch.equal(torch.cat([cpu_kernels.cpu_qlinear(x[i : i + 1], packed) for i in range(67)]), batched)
    assert torch.equal(cpu_kernels.cpu_qlinear(x, packed, plain=True), batched)


AVX2_RUN = textwrap.dedent(
    """
    import sys, torch
    from engine.model import cpu_kernels
    from tests.test_qlinear import AVX2_ROWS, avx2_case
    print(cpu_kernels.qlinear_isa())
    for kind, x, packed in avx2_case():
        for rows in AVX2_ROWS:
            torch.save(cpu_kernels.cpu_qlinear(x[:rows], packed), f"{sys.argv[1]}/{kind}-{rows}.pt")
    """
)


AVX2_ROWS = (3, 19)  # fewer rows than the AVX2 path splits a 4-bit column's nibbles for, and more


def avx2_case() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(4))
    return [(kind, x, pack(weight(48, 576, kind))) for kind in KINDS]


@pytest.mark.skipif("avx2" not in cpu_kernels.read_cpu_facts().flags, reason="the AVX2 build needs an AVX2 CPU")
def test_the_avx2_build_gives_the_same_bits(tmp_path) -> None:
    """The kernels built as for an AVX2-only CPU (HEADROOM_CPU_ISA=avx2), in a process of their own."""
    env = dict(os.environ, HEADROOM_CPU_ISA="avx2")
    run = subprocess.run(
        [sys.executable, "-c", AVX2_RUN, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[0] == "AVX2"
    for kind, x, packed in avx2_case():
        for rows in AVX2_ROWS:
            theirs = cpu_kernels.cpu_qlinear(x[:rows], packed, plain=True)
            assert torch.equal(torch.load(tmp_path / f"{kind}-{rows}.pt"), theirs), (kind, rows)


def test_embedding_rows_are_the_dequantized_rows() -> None:
    for kind in KINDS:
        raw = weight(48, 64, kind)
        ids = torch.tensor([0, 17, 47, 17])
        rows = cpu_kernels.cpu_qembedding(ids, pack(raw), torch.float32)
        assert torch.equal(rows, torch.from_numpy(raw.floats())[ids]), kind


def test_packing_refuses_outputs_that_are_not_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        pack(weight(40, 64, "q8_0"))
    assert packed_shape(pack(weight(48, 64, "q4_1"))) == (48, 64, 4)


def test_the_quantization_choice() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_quantization("auto", cpu, None).mode == "gguf"
    assert choose_quantization("none", cpu, None).mode is None
    assert choose_quantization("q8_0", cpu, None).mode == "q8_0"
    off = choose_quantization("auto", cuda, None)
    assert off.mode is None and "CPU kernels" in off.reason
    assert choose_quantization("auto", cpu, "no C++ compiler found").mode is None
    with pytest.raises(ValueError, match="cannot run: no C"):
        choose_quantization("q4_0", cpu, "no C++ compiler found")
    with pytest.raises(ValueError, match="unknown quantization"):
        choose_quantization("q3_k", cpu, None)


def logits(lm, ids: list[int]) -> torch.Tensor:
    from engine.core.kv.tensors import allocate_kv_cache
    from engine.model.attention import build_attention_metadata

    kv = allocate_kv_cache(lm.config, 8, 16, lm.model.dtype, "cpu")
    meta = build_attention_metadata([(0, len(ids), list(range(8)))], 16, "cpu")
    with torch.inference_mode():
        return lm.model.compute_logits(lm.model(torch.tensor(ids), torch.arange(len(ids)), kv, meta))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_quantized_gguf_runs_on_its_blocks(tmp_path, qtype: str) -> None:
    """The blocks kept (q/k rows unpermuted as whole rows), packed, and run: the logits match the dequantized
    model's within the activations' int8 rounding; a q/k row-order mistake would be far off."""
    import gguf

    from engine.model.loaders import load
    from tests.fixtures_llama import build_tiny_llama

    tiny = build_tiny_llama(tmp_path, tie=True, qtype=gguf.GGMLQuantizationType[qtype])
    path = str(tiny.gguf_path)
    ours, floats = load(path, torch.float32, quantization="gguf"), load(path, torch.float32)
    assert ours.model.quantized and ours.model.embed.dtype == torch.uint8 and ours.model.lm_head is ours.model.embed
    assert not floats.model.quantized
    ids = list(range(3, 40))
    got, want = logits(ours, ids), logits(floats, ids)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_the_default_model_ships_quantized_and_the_cache_keeps_it(tmp_path) -> None:
    from engine.model.loaders import load
    from engine.model.loaders.cache import ModelCache

    cache = ModelCache(tmp_path)
    first = load("default", torch.bfloat16, cache=cache, quantization="gguf")
    again = load("default", torch.bfloat16, cache=cache, quantization="gguf")  # from the cache entry
    assert any((tmp_path / "models").iterdir())
    weight_bytes = sum(p.numel() * p.element_size() for p in first.model.parameters())
    assert weight_bytes < 100e6  # Q4_1 layers and a Q8_0 embedding: 96.5 MB, where bf16 holds 269 MB
    ids = first.tokenizer.encode("The capital of France is")
    assert torch.equal(logits(first, ids), logits(again, ids))


def test_a_matrix_without_whole_blocks_of_outputs_stays_float() -> None:
    """A vocabulary of 32,001, say: that matrix is dequantized, the others stay packed."""
    from engine.model.checkpoint import fused_weight

    odd, even = weight(40, 64, "q8_0"), weight(48, 64, "q8_0")
    assert fused_weight([odd], "gguf").dtype == torch.float32
    assert fused_weight([even], "gguf").dtype == torch.uint8
    assert fused_weight([torch.from_numpy(odd.floats())], "q4_1").dtype == torch.float32
