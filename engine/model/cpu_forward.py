"""The decoder layers of a step as one C++ call (engine/model/csrc/forward.cpp), where every op of a layer
already runs on Headroom's CPU kernels: the same kernels in the same order, so the same bits, without the
Python between them (nine calls a layer; at one decode stream about a quarter of the step). Every dense family
runs so (engine/model/model_config.py: biases, head norms, sandwich norms, GeGLU, windows, soft-capping, a
second RoPE table); a mixture of experts stays in the Python loop, whose routing is torch's.

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
_POINTERS = ("positions", "cos", "sin", "cos_local", "sin_local", "slots", "tables", "token_seq", "token_ctx", "layer")
SCRATCH = ("x", "delta", "h", "qkv", "attn", "proj", "gate_up", "act")
# a layer's weights in forward.cpp's `Layer`: the norms every family has, its packed linears, then the weights
# only some families have (DecoderLayer's attributes, None where absent)
NORMS = ("attn_norm", "mlp_norm")
LINEARS = ("qkv", "o", "gate_up", "down")
OPTIONAL = ("qkv_bias", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")
ACTIVATIONS = ("silu", "gelu_tanh")  # Step.gelu: the index here


class Layer(ctypes.Structure):
    """forward.cpp's `Layer`, field for field."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in (*NORMS, *LINEARS, *OPTIONAL, "k_cache", "v_cache")),
        ("kinds", ctypes.c_int32 * len(LINEARS)),
        ("window", ctypes.c_int32),
        ("local", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
    ]


class Step(ctypes.Structure):
    """forward.cpp's `Step`, field for field."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in (*_I64, "table_row")),
        ("eps", ctypes.c_float),
        ("bf16", ctypes.c_int32),
        ("kv_f16", ctypes.c_int32),
        ("threads", ctypes.c_int32),
        ("gelu", ctypes.c_int32),
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


def _address(weight: torch.Tensor | PackedLinear | None) -> int | None:
    if weight is None:
        return None
    return (weight.blocks if isinstance(weight, PackedLinear) else weight).data_ptr()


class FusedLayers:
    def __init__(self, model: LlamaModel) -> None:
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
        self.gelu = ACTIVATIONS.index(cfg.activation)
        self.layers = (Layer * cfg.num_layers)()
        for layer, decoder in zip(self.layers, model.layers, strict=True):
            weights = (decoder.attn_norm, decoder.mlp_norm, *decoder.packed, *(getattr(decoder, n) for n in OPTIONAL))
            for name, weight in zip((*NORMS, *LINEARS, *OPTIONAL), weights, strict=True):
                setattr(layer, name, _address(weight))
            layer.kinds[:] = [linear_kind(w) for w in decoder.packed]
            spec = decoder.spec
            layer.window, layer.local = spec.window or 0, decoder.local_rope
            layer.scale, layer.softcap = spec.scale, spec.softcap or 0.0

    def __call__(
        self,
        x: torch.Tensor,
        ropes: tuple[tuple[torch.Tensor, ...], ...],
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], the embeddings (updated in place into the residual stream); ropes: the global and the local
        tables' `rope_state`s. Returns (x, delta) as the Python loop leaves them for the final norm."""
        (cos, sin, positions), (cos_local, sin_local, _) = ropes
        tokens = x.shape[0]
        for layer, (k, v) in zip(self.layers, kv_caches, strict=True):
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
        scratch = {name: torch.empty((tokens, width), dtype=x.dtype) for name, width in self.widths.items()}
        token_seq, token_ctx = meta.token_plan
        tables = meta.block_tables
        step = Step(
            tokens=tokens, block_size=meta.block_size, table_row=tables.stride(0), eps=self.model.cfg.rms_norm_eps,
            bf16=x.dtype == torch.bfloat16, kv_f16=kv_caches[0][0].dtype == torch.float16,
            threads=torch.get_num_threads(), gelu=self.gelu,
            positions=positions.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), cos_local=cos_local.data_ptr(),
            sin_local=sin_local.data_ptr(), slots=meta.slot_mapping.data_ptr(), tables=tables.data_ptr(),
            token_seq=token_seq.data_ptr(), token_ctx=token_ctx.data_ptr(), layer=ctypes.addressof(self.layers),
            x=x.data_ptr(), **self.dims, **{name: t.data_ptr() for name, t in scratch.items()},
        )  # fmt: skip
        load_library().library.headroom_decoder_layers(ctypes.byref(step))  # type: ignore[union-attr]
        return x, scratch["delta"]


def loop_reason(model: LlamaModel) -> str | None:
    """Why the layers stay in the Python loop although the model's ops are on the C++ kernels; None where
    they need not."""
    if any(layer.moe for layer in model.layers):
        return "mixture-of-experts layers"
    if any(linear_kind(w) is None for layer in model.layers for w in layer.packed or (None,)):
        return "a linear on torch"
    return None


def fused_layers(model: LlamaModel) -> FusedLayers | None:
    """The one-call layers where the model's ops are the C++ kernels, no layer is a mixture of experts and
    every linear is packed for one of the kernels (after `pack_linears`); else None."""
    if not isinstance(model.ops, CpuKernelOps) or load_library().library is None or loop_reason(model):
        return None
    return FusedLayers(model)
