"""HF checkpoint directories: config.json, one or sharded *.safetensors, tokenizer.json and the chat template
from tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from engine.model.families import UnsupportedModelError, config_from_hf, hf_weights_as_llama
from engine.model.model_config import ModelConfig
from engine.model.tokenizer import Tokenizer, special_tokens_processor


def read_config(path: Path) -> ModelConfig:
    try:
        return config_from_hf(json.loads((path / "config.json").read_text()))
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{path}: {e}") from None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(path / f))
    return weights


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    return token.get("content") if isinstance(token, dict) else token


def read_tokenizer(path: Path) -> Tokenizer:
    hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
    tc_path = path / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").exists():  # newer transformers save it apart
        template = (path / "chat_template.jinja").read_text()
    eos: set[int] = set()
    gen_eos = gen.get("eos_token_id")
    eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    eos_text = _token_content(tc.get("eos_token"))
    if eos_text is not None and (eos_id := hf.token_to_id(eos_text)) is not None:
        eos.add(eos_id)
    bos_text = _token_content(tc.get("bos_token"))
    bos_id = hf.token_to_id(bos_text) if bos_text else None
    if "add_bos_token" in tc or "add_eos_token" in tc:  # transformers' rule: the config overrides tokenizer.json
        eos_id = hf.token_to_id(eos_text) if eos_text is not None else None
        hf.post_processor = special_tokens_processor(
            hf, bos_id if tc.get("add_bos_token") else None, eos_id if tc.get("add_eos_token") else None
        )
    return Tokenizer(hf, name=path.name, eos_token_ids=eos, bos_token_id=bos_id, chat_template=template)


def read_hf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    path = Path(path)
    config, weights = read_config(path), read_weights(path)
    hf_weights_as_llama(config, weights)
    return config, weights, read_tokenizer(path)
