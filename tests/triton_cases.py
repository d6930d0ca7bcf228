"""The Triton decode kernel's checks, run by tests/test_triton_decode.py in a process of their own: Triton's CPU
interpreter (TRITON_INTERPRET=1) must be chosen before triton is first imported, which the test session may have
done already. `python -m tests.triton_cases` prints one line per check and exits non-zero on the first failure."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

from engine.model.triton_decode import paged_decode_attention
from tests.test_cuda_graphs import EagerCapture, generate, prompts

# bf16 operands and output: its rounding alone, 2^-8 relative, spread over a unit-norm output (METHOD: 1e-3..1e-2)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def reference(q, k_cache, v_cache, tables, lens) -> torch.Tensor:  # noqa: ANN001
    """Float64 attention of each sequence's one query over its first lens[b] cached keys, head by head."""
    b_, heads, dim = q.shape
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(b_, heads, dim, dtype=torch.float64)
    for b in range(b_):
        n = int(lens[b])
        blocks = tables[b, : -(-n // bs)].long()
        k = k_cache[blocks].reshape(-1, kv_heads, dim)[:n].double()
        v = v_cache[blocks].reshape(-1, kv_heads, dim)[:n].double()
        for h in range(heads):
            kh = h // (heads // kv_heads)
            out[b, h] = torch.softmax(q[b, h].double() @ k[:, kh].T * dim**-0.5, -1) @ v[:, kh]
    return out


def padded_cache(blocks: int, bs: int, kv_heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A cache whose blocks lie further apart than their bytes, as a pool in CUDA virtual memory packs every
    layer's K and V of a block together: the kernel must follow the block stride it is given."""
    inner = bs * kv_heads * dim
    raw = torch.randn(blocks, 3 * inner, dtype=dtype)
    return raw[:, inner : 2 * inner].view(blocks, bs, kv_heads, dim)


def check_kernel() -> None:
    torch.manual_seed(0)
    for heads, kv_heads, dim, dtype in (
        (8, 2, 64, torch.bfloat16),
        (4, 4, 16, torch.float32),
        (6, 2, 32, torch.float32),
    ):
        bs, blocks = 16, 48
        q = torch.randn(5, 3 * heads, dim, dtype=dtype)[:, ::3]  # a strided view, as the model's q is
        k, v = (padded_cache(blocks, bs, kv_heads, dim, dtype) for _ in range(2))
        lens = torch.tensor([1, bs, bs + 1, 97, 12 * bs], dtype=torch.int32)
        tables = torch.stack([torch.randperm(blocks)[:12] for _ in range(5)]).to(torch.int32)
        out = paged_decode_attention(q, k, v, tables, lens, dim**-0.5)
        ref = reference(q, k, v, tables, lens)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        print(f"kernel heads {heads}/{kv_heads} dim {dim} {dtype}: relative error {err:.2e}")
        assert out.dtype == dtype and out.shape == q.shape and err < TOLERANCE[dtype], err


def check_graph_decode() -> None:
    """The tiny model decoding through the graph path on Triton's kernel gives the eager sdpa run's tokens."""
    from tests.fixtures_llama import build_tiny_llama
    from tests.test_cuda_graphs import backend

    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_llama(Path(tmp))
        eager_tokens, _ = generate(backend(tiny), prompts(backend(tiny), 3))
        b = backend(tiny)
        b.graphs = b.make_decode_graphs(capture := EagerCapture(), "triton_decode")
        tokens, _ = generate(b, prompts(b, 3))
    print(f"graph decode on triton_decode: {capture.replays} replays, tokens equal: {tokens == eager_tokens}")
    assert tokens == eager_tokens and capture.replays == 5


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1" and "triton" not in sys.modules
    check_kernel()
    check_graph_decode()
