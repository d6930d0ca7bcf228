"""The attention kernel and block size, chosen together (engine/model/kernel_choice.py), on a faked CUDA device
with the fake flash_attn of tests/fakes on sys.path; and engine/model/attention.py's flash path called the way
upstream flash-attn wants (the fake enforces upstream's argument checks)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.kv.tensors import allocate_kv_cache
from engine.factory import _default_block_size
from engine.model.attention import build_attention_metadata, paged_attention
from engine.model.attention_metadata import AttentionSpec
from engine.model.kernel_choice import choose_kernel, flash_attn_load_error
from engine.model.llama import ModelConfig

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
UNDEFINED_SYMBOL = "flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDeviceEa"


@pytest.fixture(autouse=True)
def flash_attn_imported_afresh() -> Iterator[None]:
    """The import is cached per process; each test puts its own flash_attn (or none) on the path."""
    flash_attn_load_error.cache_clear()
    yield
    flash_attn_load_error.cache_clear()


def without_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ModuleNotFoundError
    flash_attn_load_error.cache_clear()


@pytest.fixture
def no_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    without_flash(monkeypatch)


def broken_flash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception) -> Path:
    """A flash_attn on sys.path whose import raises `error`, as a wheel built for another torch does when its
    extension loads; returns the file each import attempt appends a line to."""
    (tmp_path / "flash_attn").mkdir()
    tries = tmp_path / "import_tries"
    (tmp_path / "flash_attn" / "__init__.py").write_text(f"open({str(tries)!r}, 'a').write('x\\n')\nraise {error!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    return tries


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
    with monkeypatch.context() as m:  # undone before fake_flash takes its module out of sys.modules
        without_flash(m)
        assert _default_block_size(EngineConfig(device="cuda", dtype="bfloat16")) == 16


@pytest.mark.parametrize(
    "error", [ImportError(f"{UNDEFINED_SYMBOL}\nmore"), OSError("libcudart.so.12: cannot open shared object file")]
)
def test_a_flash_attn_that_does_not_load_is_not_taken_and_the_reason_quotes_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    """Found on the path is not enough: auto falls back to sdpa with the import's error, and asking for flash
    fails at start-up (choose_kernel runs before the model loads) instead of at the first step."""
    broken_flash(tmp_path, monkeypatch, error)
    first_line = str(error).splitlines()[0]
    choice = choose_kernel("auto", None, CUDA, torch.bfloat16)
    assert (choice.attention, choice.block_size) == ("sdpa", 16)
    assert f"flash_attn does not load ({type(error).__name__}: {first_line})" in choice.reason
    assert "more" not in choice.reason
    with pytest.raises(ValueError, match="attention backend 'flash' cannot run: flash_attn does not load") as err:
        choose_kernel("flash", None, CUDA, torch.bfloat16)
    assert first_line in str(err.value)


def test_asking_for_flash_where_it_is_missing_or_cannot_run_this_dtype_fails_at_start_up(no_flash) -> None:
    with pytest.raises(ValueError, match="flash_attn is not installed"):
        choose_kernel("flash", None, CUDA, torch.bfloat16)
    with pytest.raises(ValueError, match="flash_attn is not installed"):
        _default_block_size(EngineConfig(device="cuda", dtype="bfloat16", attention="flash"))
    with pytest.raises(ValueError, match="16-bit dtype"):
        choose_kernel("flash", None, CUDA, torch.float32)


def test_flash_attn_is_imported_once_per_process_and_only_where_it_could_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tries = broken_flash(tmp_path, monkeypatch, ImportError(UNDEFINED_SYMBOL))
    choose_kernel("auto", None, CPU, torch.bfloat16)
    choose_kernel("auto", None, CUDA, torch.float32)
    assert not tries.exists(), "flash_attn imported off CUDA or for a dtype it cannot run"
    for _ in range(3):
        choose_kernel("auto", None, CUDA, torch.bfloat16)
    assert tries.read_text() == "x\n"


@pytest.mark.parametrize(
    "spec", [AttentionSpec(scale=0.25), AttentionSpec(scale=0.2, window=37, softcap=3.0)], ids=["plain", "gemma2"]
)
def test_flash_path_passes_upstream_arguments_and_matches_sdpa(fake_flash, spec: AttentionSpec) -> None:
    """engine/model/attention.py's flash call, through the fake that checks what upstream's kernel checks (paged
    block size, int32 block table and cu_seqlens), agrees with the sdpa kernel on prefills, a chunk over
    cached context and decodes in one ragged batch, and reads a layer's window and soft-cap the same way."""
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
        out[backend] = paged_attention(q, k, v, kv, build_attention_metadata(seqs, bs, CPU, backend), spec)
    assert fake_flash.CALLS == ["flash_attn_varlen_func"]
    torch.testing.assert_close(out["flash"], out["sdpa"], atol=1e-4, rtol=1e-4)
