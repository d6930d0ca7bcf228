"""Llama in plain torch, over a flattened ragged batch and a paged KV cache.

Weights use HF's layout and RoPE convention (rotate_half); q/k/v and gate/up are fused into one matmul
each, which on CPU saves more time than anything else at small batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import quant
from engine.model.attention import paged_attention
from engine.model.attention_metadata import AttentionMetadata, KVCache
from engine.model.batch_invariance import linear_weight, padded_linear
from engine.model.cpu_kernels import cpu_qembedding
from engine.model.model_config import ModelConfig
from engine.model.quant import RawQuant, is_packed, packed_shape

if TYPE_CHECKING:
    from engine.model.cpu_kernels import CpuKernelOps, PackedLinear


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with HF's rope scaling applied."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "freq_factors":
        return (inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)).float()
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}: only llama3 and linear are implemented")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled).float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalized in fp32 and cast back before the weight, as HF's LlamaRMSNorm does (one fused op for the
    normalization: it runs twice in every layer of every step)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class TorchOps:
    """The model's elementwise ops in plain torch, for every device and dtype. On the CPU the backend swaps in
    engine/model/cpu_kernels.py `CpuKernelOps`, the same ops as one C++ call each."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual); residual None: nothing added."""
        if residual is not None:
            x = x + residual
        return rms_norm(x, weight, eps), x

    def rope_state(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What `rope` needs for one step, from the [max_pos, 1, head_dim] tables: made once, read by every
        layer."""
        return cos[positions], sin[positions]

    def rope(self, qk: torch.Tensor, state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """qk [T, heads, head_dim] rotated (HF's rotate_half convention)."""
        cos, sin = state
        return qk * cos + rotate_half(qk) * sin

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _whole(x: torch.Tensor) -> torch.Tensor:
    """On one device a projection's output is already whole."""
    return x


def _param(*shape: int, dtype: torch.dtype, device: str | torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.attn_norm = _param(d, dtype=dtype, device=device)
        self.wqkv = _param(self.q_size + 2 * self.kv_size, d, dtype=dtype, device=device)
        self.wo = _param(d, self.q_size, dtype=dtype, device=device)
        self.mlp_norm = _param(d, dtype=dtype, device=device)
        self.w_gate_up = _param(2 * cfg.intermediate_size, d, dtype=dtype, device=device)
        self.w_down = _param(d, cfg.intermediate_size, dtype=dtype, device=device)
        self.packed: tuple[torch.Tensor | PackedLinear, ...] | None = None  # pack_linears(): what the forward runs

    def pack_linears(self, cpu_kernel: bool) -> None:
        """Run the linears on weights packed for their kernel (engine/model/batch_invariance.py `linear_weight`)."""
        weights = (self.wqkv, self.wo, self.w_gate_up, self.w_down)
        self.packed = tuple(linear_weight(w.detach(), cpu_kernel) for w in weights)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        rope: tuple[torch.Tensor, ...],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        ops: TorchOps | CpuKernelOps,
        min_rows: int = 1,
        reduce: Callable[[torch.Tensor], torch.Tensor] = _whole,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; delta: the previous layer's MLP output, still to be added to it (None for
        the first layer), so the add runs inside the norm. Returns this layer's (x, delta).
        min_rows: every linear runs over at least this many rows (LlamaModel.linear_min_rows). reduce: makes a
        row-parallel projection's partial sum whole (LlamaModel.reduce)."""
        cfg, t = self.cfg, x.shape[0]
        wqkv, wo, w_gate_up, w_down = self.packed or (self.wqkv, self.wo, self.w_gate_up, self.w_down)
        h, x = ops.rms_norm(x, self.attn_norm, cfg.rms_norm_eps, delta)
        qkv = padded_linear(h, wqkv, min_rows)
        # q and k heads are adjacent in the fused output: rotate them with one set of ops
        qk = qkv[:, : self.q_size + self.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        qk = ops.rope(qk, rope)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
        o = paged_attention(q, k, v, kv_cache, meta)
        attn = reduce(padded_linear(o.view(t, self.q_size), wo, min_rows))
        h, x = ops.rms_norm(attn, self.mlp_norm, cfg.rms_norm_eps, x)
        return x, reduce(padded_linear(ops.silu_mul(padded_linear(h, w_gate_up, min_rows)), w_down, min_rows))


class LlamaModel(nn.Module):
    # Rows every linear runs over at least (engine/model/batch_invariance.py): the backend sets it for paths
    # whose kernels otherwise round a row differently when it runs alone.
    linear_min_rows: int = 1
    # The elementwise ops: plain torch unless the backend sets the C++ kernels (engine/model/cpu_kernels.py).
    ops: TorchOps | CpuKernelOps = TorchOps()
    # All the layers as one C++ call (engine/model/cpu_forward.py), where the backend found every op on the C++
    # kernels; None: the Python loop below.
    fused: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # Sums a row-parallel projection's partial output over the tensor-parallel group (the all-reduce,
    # engine/model/tensor_parallel.py); on one device the identity.
    reduce: Callable[[torch.Tensor], torch.Tensor] = staticmethod(_whole)

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = (
            self.embed
            if cfg.tie_word_embeddings
            else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        )
        self.packed_head: torch.Tensor | PackedLinear | None = None
        freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32), rope_inv_freq(cfg))
        angles = torch.cat((freqs, freqs), dim=-1)
        # [max_pos, 1, head_dim] in the model dtype, broadcast over heads (HF casts cos/sin the same way)
        self.register_buffer("rope_cos", angles.cos()[:, None, :].to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("rope_sin", angles.sin()[:, None, :].to(dtype=dtype, device=device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (a quantized model's linears hold packed bytes: engine/model/quant.py)."""
        return self.norm.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def quantized(self) -> bool:
        """Some matrix runs on the quantized kernel (`all_quantized`: every one, embedding included)."""
        return is_packed(self.embed) or any(is_packed(w) for w in self._linears())

    @property
    def all_quantized(self) -> bool:
        return is_packed(self.embed) and all(is_packed(w) for w in self._linears())

    def _linears(self) -> list[torch.Tensor]:
        head = [] if self.lm_head is None else [self.lm_head]  # None: a tensor-parallel rank that never samples
        return [*head, *(w for x in self.layers for w in (x.wqkv, x.wo, x.w_gate_up, x.w_down))]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] over all sequences' new tokens. Returns final-norm hidden [T, D]."""
        if is_packed(self.embed):
            x, delta = cpu_qembedding(input_ids, self.embed, self.dtype), None
        else:
            x, delta = F.embedding(input_ids, self.embed), None
        rope = self.ops.rope_state(self.rope_cos, self.rope_sin, positions)
        if self.fused is not None and meta.backend == "cpu":  # the C++ paged kernel's metadata (not a graph's)
            x, delta = self.fused(x, rope, kv_caches, meta)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, delta = layer(x, delta, rope, kv_cache, meta, self.ops, self.linear_min_rows, self.reduce)
        return self.ops.rms_norm(x, self.norm, self.cfg.rms_norm_eps, delta)[0]

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in_features, out_features) of every distinct linear the model runs, for the kernels' probe."""
        shapes = (packed_shape(w)[:2][::-1] if is_packed(w) else (w.shape[1], w.shape[0]) for w in self._linears())
        return sorted(set(shapes))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, D] for the rows that sample only (a prompt's other rows never reach the vocab matmul,
        the largest one in a small model). Returns float32 [S, V]."""
        head = self.lm_head if self.packed_head is None else self.packed_head
        return padded_linear(hidden, head, self.linear_min_rows).float()

    def pack_linears(self, cpu_kernel: bool = False) -> None:
        """Pack every linear's weight for its kernel, once the weights are loaded: the unpacked parameters
        stay (the embedding, the model cache and tests read them). `cpu_kernel`: Headroom's bf16 kernel
        (engine/model/cpu_kernels.py), else oneDNN where it runs bf16, else torch's default."""
        for layer in self.layers:
            layer.pack_linears(cpu_kernel)
        self.packed_head = None if self.lm_head is None else linear_weight(self.lm_head.detach(), cpu_kernel)

    def load_hf_weights(self, weights: dict[str, torch.Tensor | RawQuant], quantization: str | None = None) -> None:
        """Copy HF-named weights (`model.layers.0.self_attn.q_proj.weight`, ...) into the fused layout. The
        dict is consumed, so each source tensor can be freed once copied. `quantization` (engine/model/quant.py):
        None, float weights; AS_SHIPPED, the linears and embedding that ship quantized stay so; a type, every
        linear and the embedding in it. A quantized weight replaces its float parameter with its packed bytes."""

        def take(*names: str) -> torch.Tensor:
            try:
                return _fused([weights.pop(n) for n in names], quantization)
            except KeyError as e:
                raise KeyError(f"checkpoint is missing {e.args[0]}") from None

        with torch.no_grad():
            _assign(self, "embed", take("model.embed_tokens.weight"))
            _assign(self, "norm", take("model.norm.weight"))
            if not self.cfg.tie_word_embeddings:
                _assign(self, "lm_head", take("lm_head.weight"))
            weights.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
            for i, layer in enumerate(self.layers):
                n = f"model.layers.{i}."
                attn, mlp = n + "self_attn.", n + "mlp."
                _assign(layer, "attn_norm", take(n + "input_layernorm.weight"))
                _assign(layer, "mlp_norm", take(n + "post_attention_layernorm.weight"))
                _assign(layer, "wqkv", take(*(f"{attn}{x}_proj.weight" for x in "qkv")))
                _assign(layer, "wo", take(attn + "o_proj.weight"))
                _assign(layer, "w_gate_up", take(mlp + "gate_proj.weight", mlp + "up_proj.weight"))
                _assign(layer, "w_down", take(mlp + "down_proj.weight"))
        if self.cfg.tie_word_embeddings:
            self.lm_head = self.embed
        unused = [n for n in weights if not n.endswith("rotary_emb.inv_freq")]
        if unused:
            raise ValueError(f"checkpoint has weights this Llama does not use: {unused[:5]}")

    def prepared_weights(self) -> dict[str, torch.Tensor]:
        """The weights in this model's own layout (fused, in its dtype), each stored once (a tied lm_head is
        the embedding): what `load_prepared_weights` takes back without redoing the checkpoint's
        conversion. The tensors are the parameters themselves, not copies."""
        state = self.state_dict()
        if self.cfg.tie_word_embeddings:
            del state["lm_head"]
        return state

    def load_prepared_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Make `prepared_weights`' tensors this model's parameters, moved to its device but otherwise not
        copied (so on CPU tensors mapped from a file stay mapped). Raises ValueError unless every weight is
        there, in the model's shape and dtype."""
        dtype = self.dtype
        wrong = [name for name, w in weights.items() if w.dtype != dtype and not is_packed(w)]
        if wrong:
            raise ValueError(f"weights {wrong[:5]} are not {dtype}")
        state = {name: w.to(self.device) for name, w in weights.items()}
        if self.cfg.tie_word_embeddings and "embed" in state:
            state["lm_head"] = state["embed"]
        try:
            for name, w in state.items():  # packed bytes take their float parameter's place, so shapes match
                module, _, leaf = name.rpartition(".")
                old = getattr(self.get_submodule(module), leaf, None)
                if is_packed(w) and old is not None and tuple(old.shape) == packed_shape(w)[:2]:
                    _assign(self.get_submodule(module), leaf, w)
            self.load_state_dict(state, assign=True)
        except (RuntimeError, TypeError, AttributeError, KeyError) as e:  # missing, unexpected or misshapen weights
            raise ValueError(str(e)) from e
        if self.cfg.tie_word_embeddings:
            self.lm_head = self.embed


def _fused(parts: list[torch.Tensor | RawQuant], quantization: str | None) -> torch.Tensor:
    """One weight from its checkpoint parts (q/k/v, gate/up, or a single one): packed quantized bytes where
    `quantization` asks for them (engine/model/quant.py), else the floats, dequantized where they ship quantized.
    Parts that ship quantized in the asked type (or, AS_SHIPPED, in one type) are packed as they are. A matrix
    whose outputs are not whole blocks of 16, or whose inputs are not whole blocks of 32, stays float (a
    vocabulary of 32,001, say); so do the norms."""
    kinds = {p.kind if isinstance(p, RawQuant) else None for p in parts}
    (kind,) = kinds if len(kinds) == 1 else (None,)
    rows = sum(p.data.shape[0] if isinstance(p, RawQuant) else p.shape[0] for p in parts)
    if kind is not None and quantization in (quant.AS_SHIPPED, kind) and quant.packable(rows):
        return quant.pack(quant.concat(parts))  # type: ignore[arg-type]
    floats = torch.cat([torch.from_numpy(p.floats()) if isinstance(p, RawQuant) else p for p in parts])
    blocks = floats.dim() == 2 and quant.packable(rows) and floats.shape[1] % quant.QK == 0
    if quantization in quant.KINDS and blocks:
        return quant.pack(quant.quantize(floats.float().numpy(), quantization))  # type: ignore[arg-type]
    return floats


def _assign(module: nn.Module, name: str, weight: torch.Tensor) -> None:
    """Copy a float weight into its parameter (cast to its dtype); a packed one replaces the parameter."""
    if is_packed(weight):
        setattr(module, name, nn.Parameter(weight, requires_grad=False))
    else:
        getattr(module, name).copy_(weight)
