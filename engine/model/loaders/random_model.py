"""A Llama of any shape with random weights, for measuring kernels and memory where no checkpoint may be
downloaded (bench/device_check.py: Llama-3.1-8B's shape on a lent GPU). Its tokens mean nothing, so it
comes with the stand-in tokenizer."""

from __future__ import annotations

import torch

from engine.model.llama import LlamaModel
from engine.model.loaders import LoadedModel
from engine.model.model_config import ModelConfig
from engine.model.standin_tokenizer import StandInTokenizer

INIT_STD = 0.02  # HF's initializer_range for Llama: keeps activations finite through every layer


def random_llama(
    cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device, seed: int = 0, name: str = "random"
) -> LoadedModel:
    """Weights drawn N(0, INIT_STD^2) on the device itself (no host copy of an 8B model), norms at one."""
    model = LlamaModel(cfg, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, INIT_STD, generator=gen)
    return LoadedModel(model, cfg, StandInTokenizer(), name)  # type: ignore[arg-type]
