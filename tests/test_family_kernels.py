"""Every dense family on the C++ CPU kernels (engine/model/cpu_forward.py, engine/model/csrc/): its decoder layers
run as one C++ call, that call gives the Python loop's bits on a ragged batch (prefills past the sliding window,
a chunk, decodes), and the kernels agree with the plain-torch model; a mixture of experts stays in the Python loop
and says so; Gemma's GeGLU is torch's in one call. The families are built from their ModelConfigs with random
weights (transformers' own models are the reference in tests/test_model_families.py). Paged attention's windows
and soft-capping are checked in tests/test_model.py."""

from __future__ import annotations

import pytest
import torch

from engine.backends.torch_backend import TorchBackend
from engine.core.kv.tensors import allocate_kv_cache
from engine.model import cpu_kernels
from engine.model.attention import build_attention_metadata
from engine.model.cpu_kernels import CpuKernelOps
from engine.model.llama import TorchOps
from engine.model.loaders.random_model import random_llama
from engine.model.model_config import ModelConfig
from tests.kernel_build import require_cpu_kernels

BLOCK, WINDOW, ORIGINAL_CONTEXT = 16, 20, 64  # a window crossing block edges; Phi-3's context before longrope
SHAPE = {
    "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_layers": 4, "num_heads": 4,
    "num_kv_heads": 2, "head_dim": 32, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
}  # fmt: skip
SANDWICH = {"sandwich_norms": True, "activation": "gelu_tanh", "embed_scale": 128**0.5, "tie_word_embeddings": True}
FACTORS = 16  # longrope's factors: one per rotated pair (head_dim / 2)
FAMILIES = {
    "llama": {"rope_theta": 500000.0},
    "mistral": {"sliding_window": WINDOW, "sliding_layers": [0, 1, 2, 3]},
    "qwen2": {"attention_bias": True, "tie_word_embeddings": True},
    "qwen3": {"qk_norm": True},
    "gemma2": {
        **SANDWICH, "attn_scale": 24**-0.5, "attn_softcap": 2.0, "final_softcap": 5.0, "sliding_window": WINDOW,
        "sliding_layers": [0, 2],
    },
    "gemma3": {
        **SANDWICH, "qk_norm": True, "attn_scale": 16**-0.5, "sliding_window": WINDOW, "sliding_layers": [0, 1, 3],
        "rope_theta": 1000000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "local_rope_theta": 10000.0,
    },
    "phi3": {
        "rope_scaling": {
            "rope_type": "longrope", "original_max_position_embeddings": ORIGINAL_CONTEXT,
            "short_factor": [1.0 + 0.05 * i for i in range(FACTORS)],
            "long_factor": [1.5 + 0.25 * i for i in range(FACTORS)],
        },
    },
}  # fmt: skip
MOE = {"num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 64, "moe_layers": [1, 2]}
WEIGHT_STD = 0.15  # wider than random_llama's, so that soft-capping, windows and head norms change the result
# (start, new tokens, block table) per sequence, per step: prefills longer than the window (one past Phi-3's
# original context), then a chunk beside decodes, then a step of decodes
STEPS = [
    [(0, 70, [0, 1, 2, 3, 4]), (0, 5, [5])],
    [(70, 1, [0, 1, 2, 3, 4]), (5, 3, [5]), (0, 30, [6, 7])],
    [(71, 1, [0, 1, 2, 3, 4]), (8, 1, [5]), (30, 1, [6, 7])],
]
NUM_BLOCKS = 8


def family_backend(name: str, dtype: torch.dtype, **kwargs: object) -> TorchBackend:
    """The family's model with random weights: matrices N(0, WEIGHT_STD^2), norms near one, biases small."""
    cfg = ModelConfig(**SHAPE, **(MOE if name == "qwen3_moe" else FAMILIES[name]))
    loaded = random_llama(cfg, dtype, "cpu")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in loaded.model.named_parameters():
            if pname.endswith("norm"):
                p.copy_(1 + torch.randn(p.shape, generator=g) / 10)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (WEIGHT_STD if p.dim() > 1 else 0.5))
    return TorchBackend(loaded, dtype=str(dtype).removeprefix("torch."), device="cpu", num_blocks=4, **kwargs)


def hidden_states(backend: TorchBackend, fused: bool = True) -> list[torch.Tensor]:
    """Every row's final-norm hidden state over STEPS, on fresh caches; fused False: the Python loop."""
    model = backend.model
    saved, model.fused = model.fused, model.fused if fused else None
    kv = allocate_kv_cache(backend.config, NUM_BLOCKS, BLOCK, model.dtype, "cpu")
    g = torch.Generator().manual_seed(0)
    out = []
    try:
        for seqs in STEPS:
            ids = torch.randint(0, backend.config.vocab_size, (sum(n for _, n, _ in seqs),), generator=g)
            positions = torch.cat([torch.arange(start, start + n) for start, n, _ in seqs])
            meta = build_attention_metadata(seqs, BLOCK, "cpu", backend=backend.attention)
            with torch.inference_mode():
                out.append(model(ids, positions, kv, meta))
    finally:
        model.fused = saved
    return out


def require_linear_kernel(dtype: torch.dtype) -> None:
    require_cpu_kernels()
    if (why := cpu_kernels.linear_unusable_reason(dtype)) is not None:
        pytest.skip(f"the {dtype} linears run on torch here ({why}): the layers stay in Python")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FAMILIES)
def test_one_call_gives_the_python_loops_bits(name: str, dtype: torch.dtype) -> None:
    require_linear_kernel(dtype)
    backend = family_backend(name, dtype)
    assert backend.model.fused is not None and "decoder layers: one C++ call a step" in backend.kernel_reason
    for fused, loop in zip(hidden_states(backend), hidden_states(backend, fused=False), strict=True):
        assert torch.equal(fused, loop)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_kernels_agree_with_plain_torch(name: str) -> None:
    require_linear_kernel(torch.float32)
    kernels = hidden_states(family_backend(name, torch.float32))
    plain = hidden_states(family_backend(name, torch.float32, attention="sdpa"))
    for ours, theirs in zip(kernels, plain, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_a_mixture_of_experts_stays_in_the_python_loop() -> None:
    require_cpu_kernels()
    backend = family_backend("qwen3_moe", torch.float32)
    assert backend.attention == "cpu" and backend.model.fused is None
    assert "decoder layers: Python loop (mixture-of-experts layers)" in backend.kernel_reason


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gelu_tanh_mul_is_torchs_in_one_call(dtype: torch.dtype, tolerance: float) -> None:
    """Against torch's gelu(approximate="tanh") * up (bf16: torch rounds between the two, the kernel once), on a
    width that is not a multiple of 16 (the tail); a row alone gives the bits it gives in the batch."""
    require_cpu_kernels()
    gate_up = (torch.randn(37, 2 * 1003, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    ours = CpuKernelOps().gelu_tanh_mul(gate_up)
    assert ours.dtype == dtype and ours.shape == (37, 1003)
    torch.testing.assert_close(ours, TorchOps().gelu_tanh_mul(gate_up), atol=tolerance, rtol=tolerance)
    assert torch.equal(CpuKernelOps().gelu_tanh_mul(gate_up[5:6]), ours[5:6])
