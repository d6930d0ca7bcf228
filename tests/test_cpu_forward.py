"""The decoder layers as one C++ call (engine/model/cpu_forward.py): the same kernels in the same order as the
Python loop, so the same bits, for prefills, chunks and decodes in one step."""

from __future__ import annotations

import pytest
import torch

from engine.backends.torch_backend import TorchBackend
from engine.core.kv.tensors import allocate_kv_cache
from engine.model import cpu_kernels
from engine.model.attention import build_attention_metadata
from tests.kernel_build import require_cpu_kernels

BLOCK = 16


def step_logits(backend: TorchBackend, fused: bool) -> list[torch.Tensor]:
    """Two steps over fresh caches: a prefill of 37 tokens with another of 5, then one decode for the first and a
    chunk of 3 for the second: every row's logits."""
    model = backend.model
    saved, model.fused = model.fused, model.fused if fused else None
    kv = allocate_kv_cache(backend.config, 8, BLOCK, model.dtype, "cpu")
    g = torch.Generator().manual_seed(0)
    out = []
    try:
        for seqs in ([(0, 37, [0, 1, 2]), (0, 5, [3])], [(37, 1, [0, 1, 2]), (5, 3, [3])]):
            ids = torch.randint(100, 40000, (sum(n for _, n, _ in seqs),), generator=g)
            positions = torch.cat([torch.arange(start, start + n) for start, n, _ in seqs])
            meta = build_attention_metadata(seqs, BLOCK, "cpu", backend="cpu")
            with torch.inference_mode():
                out.append(model.compute_logits(model(ids, positions, kv, meta)))
    finally:
        model.fused = saved
    return out


CASES = [("auto", "bfloat16"), ("auto", "float32"), ("none", "bfloat16"), ("none", "float32")]


@pytest.mark.parametrize(("quantization", "dtype"), CASES)
def test_one_call_gives_the_python_loops_bits(quantization: str, dtype: str) -> None:
    require_cpu_kernels()
    if quantization == "none" and (why := cpu_kernels.linear_unusable_reason(getattr(torch, dtype))) is not None:
        pytest.skip(f"the float linears run on torch here ({why}): the layers stay in Python")
    backend = TorchBackend("default", dtype=dtype, device="cpu", num_blocks=8, quantization=quantization)
    assert backend.model.fused is not None, backend.kernel_reason
    assert "decoder layers: one C++ call a step" in backend.kernel_reason
    for fused, loop in zip(step_logits(backend, True), step_logits(backend, False), strict=True):
        assert torch.equal(fused, loop)


def test_ops_on_torch_keep_the_python_loop() -> None:
    backend = TorchBackend("default", dtype="float32", device="cpu", num_blocks=8, attention="sdpa")
    assert backend.model.fused is None and "decoder layers" not in backend.kernel_reason
