"""The warm-start model cache (engine/model/loaders/cache.py): a load from the cache gives bit for bit the weights,
and token for token the tokenizer, of a load from the source; a changed source or dtype misses; an entry
that is damaged in any way is rebuilt; a cache that cannot be written costs nothing but the warm start.
Every cache here lives under tmp_path."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from engine.backends.torch_backend import TorchBackend
from engine.cache_dir import CACHE_DIR_ENV
from engine.config import EngineConfig
from engine.model import loaders
from engine.model.loaders import LoadedModel, load
from engine.model.loaders.cache import MANIFEST, TOKENIZER, WEIGHTS, ModelCache
from tests.conftest import default_model_installed
from tests.fixtures_llama import build_tiny_llama

TEXTS = ["Hello world!", "  spaces   and\ttabs\n\nnewlines", "12345 3.14159", "ünïcödé 東京 🙂", "<|im_start|>user\nhi"]


@pytest.fixture(scope="module")
def tinies(tmp_path_factory: pytest.TempPathFactory):
    return {tie: build_tiny_llama(tmp_path_factory.mktemp("tiny"), tie=tie) for tie in (False, True)}


@pytest.fixture(scope="module")
def tiny(tinies):
    return tinies[True]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def assert_same_model(got: LoadedModel, want: LoadedModel) -> None:
    assert got.config == want.config and got.name == want.name
    got_weights, want_weights = got.model.state_dict(), want.model.state_dict()
    assert got_weights.keys() == want_weights.keys()
    for name, w in want_weights.items():
        assert got_weights[name].dtype == w.dtype and got_weights[name].shape == w.shape, name
        assert torch.equal(bits(got_weights[name]), bits(w)), name
    assert (got.model.lm_head is got.model.embed) == (want.model.lm_head is want.model.embed)
    tok, ref = got.tokenizer, want.tokenizer
    assert tok.hf.to_str() == ref.hf.to_str()
    assert (tok.name, tok.eos_token_ids, tok.bos_token_id, tok.chat_template) == (
        ref.name, ref.eos_token_ids, ref.bos_token_id, ref.chat_template,
    )  # fmt: skip
    for text in TEXTS:
        for special in (False, True):
            ids = ref.encode(text, add_special_tokens=special)
            assert tok.encode(text, add_special_tokens=special) == ids
            assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages)


def only_entry(cache: ModelCache) -> Path:
    entries = list((cache.root / "models").iterdir())
    assert len(entries) == 1, entries
    return entries[0]


def assert_cache_round_trip(
    source: str, dtype: torch.dtype, cache: ModelCache, monkeypatch: pytest.MonkeyPatch, reference: LoadedModel
) -> None:
    """A first load through the cache (a miss: converted, then written) and a second (a hit, which must not
    touch the source readers) both give the reference model."""
    assert_same_model(load(source, dtype, cache=cache), reference)
    assert {p.name for p in only_entry(cache).iterdir()} == {WEIGHTS, TOKENIZER, MANIFEST}
    monkeypatch.setattr(loaders, "read_source", None)
    assert_same_model(load(source, dtype, cache=cache), reference)


@pytest.mark.parametrize("kind", ["gguf", "hf"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cached_load_is_bit_identical(tinies, tmp_path, monkeypatch, kind: str, tie: bool, dtype) -> None:
    tiny = tinies[tie]
    source = str(tiny.gguf_path if kind == "gguf" else tiny.hf_dir)
    assert_cache_round_trip(source, dtype, ModelCache(tmp_path), monkeypatch, load(source, dtype))


@pytest.mark.skipif(not default_model_installed(), reason="the default model is not installed")
def test_default_model_cached_load_is_bit_identical(tmp_path, monkeypatch) -> None:
    """The shipped GGUF: a 49k-token byte-level BPE with SmolLM's digit splitting, Q4_1 weights."""
    assert_cache_round_trip("default", torch.bfloat16, ModelCache(tmp_path), monkeypatch, load("default"))


def test_entry_follows_the_source_and_the_dtype(tiny, tmp_path) -> None:
    cache = ModelCache(tmp_path)
    entry = cache.entry(tiny.gguf_path, torch.float32)
    assert cache.entry(tiny.gguf_path, torch.bfloat16) != entry
    assert cache.entry(tiny.hf_dir, torch.float32) != entry
    st = tiny.gguf_path.stat()
    try:
        os.utime(tiny.gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
        assert cache.entry(tiny.gguf_path, torch.float32) != entry
    finally:
        os.utime(tiny.gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cache.entry(tiny.gguf_path, torch.float32) == entry


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def other_format(path: Path) -> None:
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "format": manifest["format"] + 1}))


def wrong_shape(path: Path) -> None:
    """A consistent entry (checksums and all) whose config does not match its weights."""
    manifest = json.loads(path.read_text())
    manifest["config"]["intermediate_size"] += 1
    path.write_text(json.dumps(manifest))


DAMAGE = {
    "weights truncated": (WEIGHTS, truncate),
    "weights bit flipped": (WEIGHTS, flip_last_byte),
    "weights missing": (WEIGHTS, Path.unlink),
    "tokenizer truncated": (TOKENIZER, truncate),
    "manifest garbage": (MANIFEST, lambda p: p.write_text("{not json")),
    "manifest of another format": (MANIFEST, other_format),
    "config unlike the weights": (MANIFEST, wrong_shape),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_entry_is_rebuilt(tiny, tmp_path, monkeypatch, caplog, damage: str) -> None:
    source = str(tiny.gguf_path)
    cache = ModelCache(tmp_path)
    reference = load(source, torch.float32, cache=cache)
    name, harm = DAMAGE[damage]
    harm(only_entry(cache) / name)
    with caplog.at_level(logging.WARNING, logger="headroom.model_cache"):
        rebuilt = load(source, torch.float32, cache=cache)
    assert "unusable" in caplog.text
    assert_same_model(rebuilt, reference)
    monkeypatch.setattr(loaders, "read_source", None)  # the rebuilt entry is whole: the next load hits
    assert_same_model(load(source, torch.float32, cache=cache), reference)


def test_unwritable_cache_still_loads(tiny, tmp_path, caplog) -> None:
    root = tmp_path / "not-a-directory"
    root.write_text("")
    with caplog.at_level(logging.WARNING, logger="headroom.model_cache"):
        loaded = load(str(tiny.gguf_path), torch.float32, cache=ModelCache(root))
    assert "could not write the model cache" in caplog.text
    assert_same_model(loaded, load(str(tiny.gguf_path), torch.float32))


def test_leftover_temporary_directory_is_not_an_entry(tiny, tmp_path) -> None:
    """A writer that died mid-write leaves only its temporary directory, which no reader takes for the entry."""
    cache = ModelCache(tmp_path)
    entry = cache.entry(tiny.gguf_path, torch.float32)
    partial = entry.parent / f".{entry.name}.dead"
    partial.mkdir(parents=True)
    (partial / WEIGHTS).write_bytes(b"partial")
    assert cache.read(tiny.gguf_path, torch.float32, lambda config, weights: None) is None
    load(str(tiny.gguf_path), torch.float32, cache=cache)
    assert entry.is_dir() and cache.read(tiny.gguf_path, torch.float32, lambda config, weights: weights)


@pytest.mark.parametrize("flag", ["--model-cache", "--no-model-cache"])
def test_backend_uses_the_cache_unless_told_not_to(tiny, tmp_path, monkeypatch, flag: str) -> None:
    """The flag reaches the backend through EngineConfig; the cache directory comes from $HEADROOM_CACHE_DIR."""
    from engine.cli import engine_config
    from engine.factory import build_backend

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    cfg = engine_config([flag, "--model", str(tiny.gguf_path), "--dtype", "float32", "--num-blocks", "4"])
    assert cfg.model_cache == (flag == "--model-cache") and EngineConfig().model_cache
    backend = build_backend(cfg)
    assert isinstance(backend, TorchBackend)
    written = list(tmp_path.glob("models/*/" + MANIFEST))
    assert len(written) == (1 if cfg.model_cache else 0)
