"""The decoder layers of a step as one C++ call (engine/model/csrc/forward.cpp), where every op of a layer
already runs on Headroom's CPU kernels: the same kernels in the same order, so the same bits, without the
Python between them (nine calls a layer; at one decode stream about a quarter of the step).

It runs where the backend put the model on the C++ kernels (`CpuKernelOps`) and every linear is packed for
one of its linear kernels (a bf16 or fp32 `PackedLinear`, or quantized bytes); elsewhere `fused_layers` is None and
LlamaModel runs its Python loop. The scratch is allocated here, as torch tensors, so the CPU probe
(telemetry/probes/cpu.py) sees the step's memory as it sees the Python loop's.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from engine.model.cpu_kernels import CpuKernelOps, PackedLinear, load_library
from engine.model.quant import is_packed, packed_shape

if TYPE_CHECKING:
    from engine.model.attention_metadata import AttentionMetadata, KVCache
    from engine.model.llama import LlamaModel

_I64 = ("tokens", "hidden", "q_size", "kv_size", "heads", "kv_heads", "head_dim", "inter", "block_size", "layers")
_POINTERS = ("positions", "cos", "sin", "slots", "tables", "token_seq", "token_ctx", "weights", "kinds")
SCRATCH = ("x", "delta", "h", "qkv", "attn", "proj", "gate_up", "act")


class Step(ctypes.Structure):
    """forward.cpp's `Step`, field for field."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in (*_I64, "table_row")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("bf16", ctypes.c_int32),
        ("threads", ctypes.c_int32),
        *((name, ctypes.c_void_p) for name in (*_POINTERS, *SCRATCH)),
    ]


def linear_kind(weight: object) -> int | None:
    """forward.cpp's code for a packed linear: 0 a float kernel, 4 or 8 the quantized one's bits; None for a
    weight that runs on torch (the layers then stay in Python)."""
    if isinstance(weight, PackedLinear):
        return 0
    if isinstance(weight, torch.Tensor) and is_packed(weight):
        return packed_shape(weight)[2]
    return None


class FusedLayers:
    def __init__(self, model: LlamaModel, kinds: list[list[int]]) -> None:
        cfg = model.cfg
        self.model = model
        hd = cfg.head_dim
        self.dims = {
            "hidden": cfg.hidden_size, "q_size": cfg.num_heads * hd, "kv_size": cfg.num_kv_heads * hd,
            "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": hd, "inter": cfg.intermediate_size,
            "layers": cfg.num_layers,
        }  # fmt: skip
        q_size, hidden, inter = self.dims["q_size"], cfg.hidden_size, cfg.intermediate_size
        self.widths = {  # each scratch buffer's row, for forward.cpp's Step
            "delta": hidden, "h": hidden, "qkv": q_size + 2 * self.dims["kv_size"], "attn": q_size, "proj": hidden,
            "gate_up": 2 * inter, "act": inter,
        }  # fmt: skip
        self.kinds = torch.tensor(kinds, dtype=torch.int32)
        self.weights = torch.zeros((cfg.num_layers, 8), dtype=torch.int64)
        for i, layer in enumerate(model.layers):
            linears = [w.blocks if isinstance(w, PackedLinear) else w for w in layer.packed or ()]
            self.weights[i, :6] = torch.tensor([t.data_ptr() for t in (layer.attn_norm, layer.mlp_norm, *linears)])

    def __call__(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], the embeddings (updated in place into the residual stream). Returns (x, delta) as the
        Python loop leaves them for the final norm."""
        cos, sin, positions = rope
        tokens = x.shape[0]
        self.weights[:, 6:] = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in kv_caches])
        scratch = {name: torch.empty((tokens, width), dtype=x.dtype) for name, width in self.widths.items()}
        token_seq, token_ctx = meta.token_plan
        tables = meta.block_tables
        step = Step(
            tokens=tokens, block_size=meta.block_size, table_row=tables.stride(0), eps=self.model.cfg.rms_norm_eps,
            scale=self.dims["head_dim"] ** -0.5, bf16=x.dtype == torch.bfloat16, threads=torch.get_num_threads(),
            positions=positions.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), slots=meta.slot_mapping.data_ptr(),
            tables=tables.data_ptr(), token_seq=token_seq.data_ptr(), token_ctx=token_ctx.data_ptr(),
            weights=self.weights.data_ptr(), kinds=self.kinds.data_ptr(), x=x.data_ptr(),
            **self.dims, **{name: t.data_ptr() for name, t in scratch.items()},
        )  # fmt: skip
        load_library().library.headroom_decoder_layers(ctypes.byref(step))  # type: ignore[union-attr]
        return x, scratch["delta"]


def fused_layers(model: LlamaModel) -> FusedLayers | None:
    """The one-call layers where the model's ops are the C++ kernels and every linear is packed for one of
    them (after `pack_linears`); else None."""
    if not isinstance(model.ops, CpuKernelOps) or load_library().library is None:
        return None
    kinds = [[linear_kind(w) for w in layer.packed or (None,)] for layer in model.layers]
    if any(k is None for row in kinds for k in row):
        return None
    return FusedLayers(model, kinds)  # type: ignore[arg-type]
