"""Our Llama against a reference implementation: transformers' LlamaForCausalLM on the same tiny random
checkpoint, in float32. A prompt's prefill and a few decode steps through the paged KV cache must give the
reference's logits, so the model is checked against more than itself."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from engine.backends.torch_backend import TorchBackend
from engine.model.attention import build_attention_metadata
from tests.fixtures_llama import build_tiny_llama
from tests.kernel_build import require_cpu_kernels

DECODE_STEPS = 4
TOLERANCE = {"atol": 2e-5, "rtol": 2e-5}


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"), tie=request.param)


@pytest.mark.parametrize("attention", ["cpu", "sdpa"])  # the C++ kernels, and the model in plain torch
@torch.inference_mode()
def test_logits_match_transformers(tiny, attention: str) -> None:
    if attention == "cpu":
        require_cpu_kernels()
    reference = LlamaForCausalLM.from_pretrained(tiny.hf_dir, dtype=torch.float32).eval()
    backend = TorchBackend(str(tiny.hf_dir), dtype="float32", device="cpu", num_blocks=8, attention=attention)
    model, bs = backend.model, backend.block_size
    ids = backend.tokenizer.encode("The capital of France is Paris. The capital of Italy is", add_special_tokens=True)
    table = [5, 2, 7, 0, 3]  # shuffled blocks, so the paging is exercised

    def ours(start: int) -> torch.Tensor:
        meta = build_attention_metadata([(start, len(ids) - start, table)], bs, "cpu")
        hidden = model(torch.tensor(ids[start:]), torch.arange(start, len(ids)), backend.kv_caches, meta)
        return model.compute_logits(hidden)

    logits = ours(0)
    torch.testing.assert_close(logits, reference(torch.tensor([ids])).logits[0], **TOLERANCE)
    for _ in range(DECODE_STEPS):
        ids.append(int(logits[-1].argmax()))
        logits = ours(len(ids) - 1)
        torch.testing.assert_close(logits, reference(torch.tensor([ids])).logits[0, -1:], **TOLERANCE)
    assert len(ids) <= len(table) * bs
