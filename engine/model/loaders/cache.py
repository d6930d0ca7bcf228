"""The warm-start cache: a model as the loader leaves it (dequantized, fused, in the chosen dtype) and its
tokenizer, kept so that the next start maps the weights from one safetensors file and reads one
tokenizer.json instead of parsing and converting the checkpoint again (the default GGUF: seconds of
metadata parsing, dequantizing and fusing; from the cache, a fraction of a second).

An entry is a directory named by a hash of its key: the source's path, size and mtime (each file's, for an
HF directory), the dtype and FORMAT_VERSION; a change to any of them is a miss, so a stale entry is never
read. It holds model.safetensors, tokenizer.json and manifest.json (the ModelConfig, the Tokenizer's other
fields, the CRC-32 of the two files). An entry is written in a temporary directory and renamed into place,
so a reader sees all of one or none; one that fails to read anyway (truncated, altered, another format) is
removed, and the caller rebuilds it from the source. A cache that cannot be written (read-only, full disk)
costs the warm start, never the load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import mmap
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from tokenizers import Tokenizer as HFTokenizer

from engine.cache_dir import default_cache_dir
from engine.model.model_config import ModelConfig
from engine.model.tokenizer import Tokenizer

FORMAT_VERSION = 1  # bump when the prepared layout or an entry's files change
WEIGHTS, TOKENIZER, MANIFEST = "model.safetensors", "tokenizer.json", "manifest.json"

logger = logging.getLogger("headroom.model_cache")
M = TypeVar("M")


def source_stamp(source: Path) -> list[tuple[str, int, int]]:
    """(absolute path, size, mtime in ns) of the source file, or of every file in the source directory."""
    files = sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]
    return [(str(p.resolve()), st.st_size, st.st_mtime_ns) for p in files for st in [p.stat()]]


def _crc32(path: Path) -> int:
    """Over a mapping of the file: no copy out of the page cache."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return zlib.crc32(data)


class ModelCache:
    def __init__(self, root: Path | None = None) -> None:
        self.root = root or default_cache_dir()

    def entry(self, source: Path, dtype: torch.dtype, quantization: str | None = None) -> Path:
        key = {"format": FORMAT_VERSION, "dtype": str(dtype), "source": source_stamp(source)}
        if quantization is not None:  # engine/model/quant.py; float entries keep the key they had
            key["quantization"] = quantization
        return self.root / "models" / hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]

    def read(
        self,
        source: Path,
        dtype: torch.dtype,
        build: Callable[[ModelConfig, dict[str, torch.Tensor]], M],
        quantization: str | None = None,
    ) -> tuple[M, ModelConfig, Tokenizer] | None:
        """The cached model of `source` in `dtype` and `quantization`, made by `build(config, prepared
        weights)` (which raises ValueError when the weights do not fit the config), or None on a miss. An entry
        that cannot be read or built from is removed, and is a miss."""
        entry = self.entry(source, dtype, quantization)
        if not entry.is_dir():
            return None
        try:
            config, weights, tokenizer = _read_entry(entry)
        except Exception as e:  # any failure to read: safetensors and tokenizers raise their own types
            return self._discard(entry, e)
        try:
            model = build(config, weights)
        except ValueError as e:
            return self._discard(entry, e)
        logger.info("loaded %s from the model cache (%s)", source.name, entry)
        return model, config, tokenizer

    def write(
        self,
        source: Path,
        dtype: torch.dtype,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        tokenizer: Tokenizer,
        quantization: str | None = None,
    ) -> None:
        """Store `weights` (LlamaModel.prepared_weights) and `tokenizer` as the entry for `source` in `dtype`
        and `quantization`."""
        entry = self.entry(source, dtype, quantization)
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
            try:
                _write_entry(tmp, config, weights, tokenizer)
                _publish(tmp, entry)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # gone already once published
        except OSError as e:
            logger.warning("could not write the model cache (%s): the next start converts %s again", e, source.name)
            return
        logger.info("wrote %s to the model cache (%s)", source.name, entry)

    def _discard(self, entry: Path, error: BaseException) -> None:
        logger.warning("model cache entry %s is unusable (%s): rebuilding it", entry, error)
        shutil.rmtree(entry, ignore_errors=True)


def _write_entry(directory: Path, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer) -> None:
    data = safetensors_bytes({name: w.detach().cpu().contiguous() for name, w in weights.items()})
    (directory / WEIGHTS).write_bytes(data)
    (directory / TOKENIZER).write_text(tokenizer.hf.to_str())
    manifest = {
        "format": FORMAT_VERSION,
        "config": dataclasses.asdict(config),
        "tokenizer": {
            "name": tokenizer.name,
            "eos_token_ids": sorted(tokenizer.eos_token_ids),
            "bos_token_id": tokenizer.bos_token_id,
            "chat_template": tokenizer.chat_template,
        },
        "crc32": {WEIGHTS: zlib.crc32(data), TOKENIZER: _crc32(directory / TOKENIZER)},
    }
    (directory / MANIFEST).write_text(json.dumps(manifest))


def _publish(tmp: Path, entry: Path) -> None:
    """Rename the finished entry into place; another process that published the same entry first wins."""
    try:
        os.rename(tmp, entry)
    except OSError:
        if not entry.is_dir():
            raise


def _read_entry(entry: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    manifest: dict[str, Any] = json.loads((entry / MANIFEST).read_text())
    if manifest["format"] != FORMAT_VERSION:
        raise ValueError(f"format {manifest['format']}, not {FORMAT_VERSION}")
    for name in (WEIGHTS, TOKENIZER):
        if _crc32(entry / name) != manifest["crc32"][name]:
            raise ValueError(f"{name} does not match its checksum")
    tok = manifest["tokenizer"]
    tokenizer = Tokenizer(
        HFTokenizer.from_file(str(entry / TOKENIZER)),
        name=tok["name"],
        eos_token_ids=set(tok["eos_token_ids"]),
        bos_token_id=tok["bos_token_id"],
        chat_template=tok["chat_template"],
    )
    # safetensors maps the file: the weights are read from the page cache as they are first used
    return ModelConfig(**manifest["config"]), load_file(entry / WEIGHTS), tokenizer
