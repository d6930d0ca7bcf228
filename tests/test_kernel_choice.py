"""The attention kernel and block size, chosen together (engine/model/kernel_choice.py), on a faked CUDA device
with the fake flash_attn of tests/fakes on sys.path; and engine/model/attention.py's flash path called the way
upstream flash-attn wants (the fake enforces upstream's argument checks)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.factory import _default_block_size
from engine.model.attention import allocate_kv_cache, build_attention_metadata, paged_attention
from engine.model.kernel_choice import choose_kernel
from engine.model.llama import ModelConfig

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture
def no_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("engine.model.kernel_choice.importlib.util.find_spec", lambda name: None)


def test_auto_on_cuda_with_flash_attn_takes_flash_and_256_blocks(fake_flash) -> None:
    choice = choose_kernel("auto", None, CUDA, torch.bfloat16)
    assert (choice.attention, choice.block_size) == ("flash", 256)
    assert choose_kernel("auto", None, CUDA, torch.float16).attention == "flash"


@pytest.mark.parametrize(
    ("device", "dtype", "why"),
    [(CUDA, torch.float32, "16-bit"), (CUDA, torch.bfloat16, "not installed")],
)  # on the CPU, auto takes the C++ kernels (tests/test_cpu_kernels.py)
def test_auto_falls_back_to_sdpa_with_16_blocks_and_says_why(device, dtype, why, request) -> None:
    request.getfixturevalue("fake_flash" if why != "not installed" else "no_flash")
    choice = choose_kernel("auto", None, device, dtype)
    assert (choice.attention, choice.block_size) == ("sdpa", 16)
    assert why in choice.reason


def test_an_explicit_block_size_is_kept_and_auto_takes_flash_only_where_it_pages(fake_flash) -> None:
    assert choose_kernel("auto", 16, CUDA, torch.bfloat16).attention == "sdpa"
    assert choose_kernel("auto", 512, CUDA, torch.bfloat16).block_size == 512
    assert choose_kernel("auto", 512, CUDA, torch.bfloat16).attention == "flash"


def test_asking_for_flash_defaults_to_its_block_size_and_refuses_what_it_cannot_run(fake_flash) -> None:
    assert choose_kernel("flash", None, CUDA, torch.bfloat16).block_size == 256
    assert choose_kernel("sdpa", None, CUDA, torch.bfloat16).block_size == 16
    with pytest.raises(ValueError, match="multiple of 256"):
        choose_kernel("flash", 128, CUDA, torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        choose_kernel("flash", None, CPU, torch.bfloat16)


def test_the_factory_sizes_the_pool_in_the_chosen_kernels_blocks(fake_flash, monkeypatch) -> None:
    """The sized pool is counted in blocks before the backend exists: the block size must be the one the
    backend will run."""
    assert _default_block_size(EngineConfig(device="cuda", dtype="bfloat16")) == 256
    assert _default_block_size(EngineConfig(device="cuda", dtype="float32")) == 16
    assert _default_block_size(EngineConfig(device="cpu")) == 16
    monkeypatch.setattr("engine.model.kernel_choice.importlib.util.find_spec", lambda name: None)
    assert _default_block_size(EngineConfig(device="cuda", dtype="bfloat16")) == 16


def test_flash_path_passes_upstream_arguments_and_matches_sdpa(fake_flash) -> None:
    """engine/model/attention.py's flash call, through the fake that checks what upstream's kernel checks (paged
    block size, int32 block table and cu_seqlens), agrees with the sdpa kernel on prefills, a chunk over
    cached context and decodes in one ragged batch."""
    h, kvh, hd, bs = 4, 2, 16, 256
    cfg = ModelConfig(100, h * hd, 64, 1, h, kvh, hd)
    lens, tables = [(0, 300), (10, 1), (255, 1), (100, 40)], [[0, 1], [2], [3, 4], [5]]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(n for _, n in lens), h, hd, generator=gen)
    k, v = (torch.randn(q.shape[0], kvh, hd, generator=gen) for _ in range(2))
    seqs = [(s, n, t) for (s, n), t in zip(lens, tables, strict=True)]
    out = {}
    for backend in ("sdpa", "flash"):
        kv = allocate_kv_cache(cfg, 8, bs, torch.float32, CPU)[0]
        out[backend] = paged_attention(q, k, v, kv, build_attention_metadata(seqs, bs, CPU, backend))
    assert fake_flash.CALLS == ["flash_attn_varlen_func"]
    torch.testing.assert_close(out["flash"], out["sdpa"], atol=1e-4, rtol=1e-4)
