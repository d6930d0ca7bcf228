"""bench/bandwidth_bound.py's bytes of a decode step: the weights as the GGUF stores them (F16 matrices, F32 norms,
Q8_0 blocks with their scales), the embedding whole only where it is also the LM head, and the KV cache of the
stream's tokens at the engine's itemsize."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from bench.bandwidth_bound import decode_step_bytes
from tests.fixtures_llama import build_tiny_llama


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0])
@pytest.mark.parametrize("tie", [False, True])
def test_a_step_reads_every_weight_as_stored_and_the_streams_kv(tmp_path: Path, tie: bool, qtype) -> None:  # noqa: ANN001
    tiny = build_tiny_llama(tmp_path, tie=tie, qtype=qtype)
    cfg = tiny.config
    stored = 0
    for name, t in tiny.weights.items():
        if name == "model.embed_tokens.weight" and not tie:
            continue  # one row of it per token: the LM head is output.weight
        if t.dim() == 1:
            stored += t.numel() * 4  # norms stay F32
        elif qtype == gguf.GGMLQuantizationType.Q8_0 and t.shape[-1] % 32 == 0:
            stored += t.numel() // 32 * 34  # 32 int8 and one f16 scale a block
        else:
            stored += t.numel() * 2
    weights, kv = decode_step_bytes(tiny.gguf_path, kv_tokens=100, kv_itemsize=2)
    assert weights == stored
    assert kv == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 100 * 2
