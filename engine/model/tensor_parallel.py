"""Megatron-style tensor parallelism of the Llama: which rows and columns of each weight a rank keeps.

- qkv and gate/up are column-parallel: a rank keeps the output rows of its query heads, its KV heads and its
  slice of the MLP's intermediate features, so its attention and activation run on its heads alone.
- o and down are row-parallel: a rank keeps the input columns that match, so each produces a partial sum of
  the full hidden vector and one all-reduce per projection (two a layer) makes it whole on every rank.
- KV heads are split across the ranks when they divide by the size; when there are fewer KV heads than ranks
  (and the size divides by them) each rank keeps the one KV head its query heads read, replicated.
- The embedding is replicated: every rank needs the whole hidden vector of every token, and a
  vocabulary-parallel lookup would add a third all-reduce a step for a table that is small beside the layers.
  The LM head lives on the driver (rank 0) only, where the sampler runs: the other ranks never compute logits,
  so they hold neither the head nor the logits (with tied embeddings the head is the embedding itself).
The sharded weights are copies: the full ones are freed as soon as every layer is sliced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig


class TensorParallelError(ValueError):
    """The model cannot be sharded at the size asked for: a start-up error whose message says why."""


@dataclass(frozen=True)
class RankShard:
    """This process's place in a tensor-parallel group and the all-reduce over it."""

    rank: int
    size: int
    reduce: Callable[[torch.Tensor], torch.Tensor]


def tp_refusal(cfg: ModelConfig, size: int) -> str | None:
    """Why this model cannot run at this tensor-parallel size (None: it can), in words for a user."""
    if size == 1:
        return None
    if cfg.num_heads % size:
        return (
            f"--tensor-parallel-size {size} does not divide the model's {cfg.num_heads} attention heads; "
            f"use a size that divides them ({', '.join(str(d) for d in _divisors(cfg.num_heads))})"
        )
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        return (
            f"--tensor-parallel-size {size}: the model's {kv} KV heads can neither be split across {size} ranks "
            "nor replicated on them (the size must divide the KV heads or be a multiple of them)"
        )
    if cfg.intermediate_size % size:
        return f"--tensor-parallel-size {size} does not divide the MLP's {cfg.intermediate_size} features"
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sharded_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """One rank's shape: its share of the query heads, KV heads (at least one) and MLP features."""
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=max(1, cfg.num_kv_heads // size),
        intermediate_size=cfg.intermediate_size // size,
    )


def kv_head_range(cfg: ModelConfig, rank: int, size: int) -> range:
    """The KV heads rank `rank` keeps: its slice, or the one head its query heads share when replicated."""
    if cfg.num_kv_heads >= size:
        per = cfg.num_kv_heads // size
        return range(rank * per, (rank + 1) * per)
    first_query = rank * (cfg.num_heads // size)
    head = first_query // (cfg.num_heads // cfg.num_kv_heads)
    return range(head, head + 1)


def shard_model(model: LlamaModel, rank: int, size: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> ModelConfig:
    """Slice every layer of a loaded float model to rank `rank`'s part, in place, and make `reduce` (the
    all-reduce over the group) sum the row-parallel outputs. Returns the rank's config."""
    full = model.cfg
    if why := tp_refusal(full, size):
        raise TensorParallelError(why)
    if model.quantized:
        raise TensorParallelError("tensor parallelism shards float weights; load the model with --quantization none")
    if full.moe_layers:
        raise TensorParallelError(f"tensor parallelism shards the dense families, not {full.architecture}'s experts")
    shard = sharded_config(full, size)
    hd = full.head_dim
    q_rows = _rows(range(rank * shard.num_heads, (rank + 1) * shard.num_heads), hd)
    kv = kv_head_range(full, rank, size)
    k_rows = [full.num_heads * hd + r for r in _rows(kv, hd)]
    v_rows = [(full.num_heads + full.num_kv_heads) * hd + r for r in _rows(kv, hd)]
    f = shard.intermediate_size
    mlp = list(range(rank * f, (rank + 1) * f))
    gate_up = mlp + [full.intermediate_size + i for i in mlp]
    with torch.no_grad():
        for layer in model.layers:
            layer.wqkv = _keep(layer.wqkv[q_rows + k_rows + v_rows])
            if layer.qkv_bias is not None:  # Qwen2's: with its heads' rows (the head norms are per head, whole)
                layer.qkv_bias = _keep(layer.qkv_bias[q_rows + k_rows + v_rows])
            layer.wo = _keep(layer.wo[:, q_rows])
            layer.w_gate_up = _keep(layer.w_gate_up[gate_up])
            layer.w_down = _keep(layer.w_down[:, mlp])
            layer.cfg, layer.q_size, layer.kv_size = shard, shard.num_heads * hd, shard.num_kv_heads * hd
    if rank != 0 and not full.tie_word_embeddings:
        model.lm_head = None  # only the driver samples
    model.reduce = reduce
    return shard


def _rows(heads: range, head_dim: int) -> list[int]:
    return [h * head_dim + i for h in heads for i in range(head_dim)]


def _keep(weight: torch.Tensor) -> nn.Parameter:
    """A contiguous copy, so the full weight it was sliced from can be freed."""
    return nn.Parameter(weight.contiguous(), requires_grad=False)
