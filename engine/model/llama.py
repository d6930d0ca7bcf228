"""The decoder in plain torch, over a flattened ragged batch and a paged KV cache: Llama, and the families
that differ from it only in data (engine/model/model_config.py, engine/model/families.py): biases on q/k/v, norms
on each head of q and k, norms after attention and MLP, GeGLU, soft-capping, sliding-window layers with a
RoPE base of their own, and a mixture of experts in place of the MLP.

Weights use HF's layout and RoPE convention (rotate_half); q/k/v and gate/up are fused into one matmul
each, which on CPU saves more time than anything else at small batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention import paged_attention
from engine.model.attention_metadata import AttentionMetadata, AttentionSpec, KVCache
from engine.model.batch_invariance import linear_weight, padded_linear
from engine.model.checkpoint import assign, load_hf_weights
from engine.model.cpu_kernels import cpu_qembedding
from engine.model.model_config import ModelConfig
from engine.model.quant import RawQuant, is_packed, packed_shape
from engine.model.rope import rope_tables

if TYPE_CHECKING:
    from engine.model.cpu_kernels import CpuKernelOps, PackedLinear


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

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Gemma's GeGLU (HF's gelu_pytorch_tanh)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def _whole(x: torch.Tensor) -> torch.Tensor:
    """On one device a projection's output is already whole."""
    return x


def _param(*shape: int, dtype: torch.dtype, device: str | torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _maybe(present: bool, *shape: int, dtype: torch.dtype, device: str | torch.device) -> nn.Parameter | None:
    """A weight only some families have: None where this one has none."""
    return _param(*shape, dtype=dtype, device=device) if present else None


def activation_mul(ops: TorchOps | CpuKernelOps, kind: str, gate_up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation of the gate times the up projection."""
    if kind == "silu":
        return ops.silu_mul(gate_up)
    if kind == "gelu_tanh":
        return ops.gelu_tanh_mul(gate_up)
    raise ValueError(f"unknown activation {kind!r}")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.spec = AttentionSpec(cfg.scale, cfg.window(index), cfg.attn_softcap)
        self.local_rope = cfg.local_rope_theta is not None and index in cfg.sliding_layers
        self.moe = index in cfg.moe_layers
        self.attn_norm = _param(d, dtype=dtype, device=device)
        self.wqkv = _param(self.q_size + 2 * self.kv_size, d, dtype=dtype, device=device)
        self.qkv_bias = _maybe(cfg.attention_bias, self.q_size + 2 * self.kv_size, dtype=dtype, device=device)
        self.q_norm = _maybe(cfg.qk_norm, hd, dtype=dtype, device=device)
        self.k_norm = _maybe(cfg.qk_norm, hd, dtype=dtype, device=device)
        self.wo = _param(d, self.q_size, dtype=dtype, device=device)
        self.post_attn_norm = _maybe(cfg.sandwich_norms, d, dtype=dtype, device=device)
        self.mlp_norm = _param(d, dtype=dtype, device=device)
        f, e = cfg.intermediate_size, cfg.num_experts
        self.w_gate_up = _maybe(not self.moe, 2 * f, d, dtype=dtype, device=device)
        self.w_down = _maybe(not self.moe, d, f, dtype=dtype, device=device)
        self.router = _maybe(self.moe, e, d, dtype=dtype, device=device)
        self.experts_gate_up = _maybe(self.moe, e, 2 * cfg.moe_intermediate_size, d, dtype=dtype, device=device)
        self.experts_down = _maybe(self.moe, e, d, cfg.moe_intermediate_size, dtype=dtype, device=device)
        self.post_mlp_norm = _maybe(cfg.sandwich_norms, d, dtype=dtype, device=device)
        self.packed: tuple[torch.Tensor | PackedLinear, ...] | None = None  # pack_linears(): what the forward runs
        self.packed_experts: list[tuple[torch.Tensor | PackedLinear, torch.Tensor | PackedLinear]] = []

    def linears(self) -> list[torch.Tensor]:
        """The matrices the layer multiplies by (an MoE layer's router and experts' gate/up and down)."""
        if self.moe:
            assert self.router is not None and self.experts_gate_up is not None and self.experts_down is not None
            return [self.wqkv, self.wo, self.router, *self.experts_gate_up, *self.experts_down]
        assert self.w_gate_up is not None and self.w_down is not None
        return [self.wqkv, self.wo, self.w_gate_up, self.w_down]

    def pack_linears(self, cpu_kernel: bool) -> None:
        """Run the linears on weights packed for their kernel (engine/model/batch_invariance.py `linear_weight`)."""
        packed = [linear_weight(w.detach(), cpu_kernel) for w in self.linears()]
        self.packed = tuple(packed[:4]) if not self.moe else tuple(packed[:3])
        if self.moe:
            e = self.cfg.num_experts
            self.packed_experts = list(zip(packed[3 : 3 + e], packed[3 + e :], strict=True))

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
        rope: this layer's table's `rope_state`. min_rows: every linear runs over at least this many rows
        (LlamaModel.linear_min_rows). reduce: makes a row-parallel projection's partial sum whole
        (LlamaModel.reduce)."""
        cfg, t = self.cfg, x.shape[0]
        wqkv, wo, *mlp = self.packed or self.linears()[:4]
        h, x = ops.rms_norm(x, self.attn_norm, cfg.rms_norm_eps, delta)
        qkv = padded_linear(h, wqkv, min_rows)
        if self.qkv_bias is not None:
            qkv += self.qkv_bias
        # q and k heads are adjacent in the fused output: rotate them with one set of ops
        qk = qkv[:, : self.q_size + self.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = self._head_norms(qk, ops)
        qk = ops.rope(qk, rope)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
        o = paged_attention(q, k, v, kv_cache, meta, self.spec)
        attn = reduce(padded_linear(o.view(t, self.q_size), wo, min_rows))
        if self.post_attn_norm is not None:
            attn = ops.rms_norm(attn, self.post_attn_norm, cfg.rms_norm_eps)[0]
        h, x = ops.rms_norm(attn, self.mlp_norm, cfg.rms_norm_eps, x)
        if self.moe:
            out = self._experts(h, ops, min_rows)
        else:
            w_gate_up, w_down = mlp
            act = activation_mul(ops, cfg.activation, padded_linear(h, w_gate_up, min_rows))
            out = padded_linear(act, w_down, min_rows)
        out = reduce(out)
        if self.post_mlp_norm is not None:
            out = ops.rms_norm(out, self.post_mlp_norm, cfg.rms_norm_eps)[0]
        return x, out

    def _head_norms(self, qk: torch.Tensor, ops: TorchOps | CpuKernelOps) -> torch.Tensor:
        """Qwen3's and Gemma 3's RMSNorm over each head of q (its weight) and of k (its own), as a fresh
        [T, heads, head_dim] (the C++ rope rotates in place: it must not write into qkv's v)."""
        t, heads, hd = qk.shape
        eps, q_heads = self.cfg.rms_norm_eps, self.cfg.num_heads
        q = ops.rms_norm(qk[:, :q_heads].reshape(-1, hd), self.q_norm, eps)[0]
        k = ops.rms_norm(qk[:, q_heads:].reshape(-1, hd), self.k_norm, eps)[0]
        return torch.cat((q.view(t, q_heads, hd), k.view(t, heads - q_heads, hd)), dim=1)

    def _experts(self, h: torch.Tensor, ops: TorchOps | CpuKernelOps, min_rows: int) -> torch.Tensor:
        """Qwen3-MoE's sparse MLP: each token's top experts by the router's softmax, each expert run over the
        tokens routed to it, their outputs weighted and summed. The experts are taken in index order, so a
        token's sum is added in the same order whatever else the batch holds."""
        cfg = self.cfg
        router = self.packed[2] if self.packed is not None else self.router
        probs = torch.softmax(padded_linear(h, router, min_rows).float(), dim=-1)
        weights, chosen = probs.topk(cfg.experts_per_token, dim=-1)
        if cfg.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(h.dtype)
        experts = self.packed_experts or list(zip(self.experts_gate_up, self.experts_down, strict=True))
        out = torch.zeros_like(h)
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            gate_up, down = experts[e]
            act = activation_mul(ops, cfg.activation, padded_linear(h[rows], gate_up, min_rows))
            out.index_add_(0, rows, padded_linear(act, down, min_rows) * weights[rows, slot, None])
        return out


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
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = (
            self.embed
            if cfg.tie_word_embeddings
            else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        )
        self.packed_head: torch.Tensor | PackedLinear | None = None
        # [max_pos, 1, head_dim] in the model dtype, broadcast over heads (HF casts cos/sin the same way); Gemma 3's
        # sliding layers have tables of their own
        cos, sin = rope_tables(cfg)[:, :, None, :].to(dtype=dtype, device=device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.rope_local: tuple[torch.Tensor, torch.Tensor] | None = None
        if cfg.local_rope_theta is not None:
            local = rope_tables(cfg, cfg.local_rope_theta, {})[:, :, None, :].to(dtype=dtype, device=device)
            self.rope_local = (local[0], local[1])

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
        return [*head, *(w for x in self.layers for w in x.linears())]

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
        if self.cfg.embed_scale != 1.0:  # Gemma's, rounded to the model dtype as HF rounds it
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        rope = self.ops.rope_state(self.rope_cos, self.rope_sin, positions)
        local = rope if self.rope_local is None else self.ops.rope_state(*self.rope_local, positions)
        if self.fused is not None and meta.backend == "cpu":  # the C++ paged kernel's metadata (not a graph's)
            x, delta = self.fused(x, (rope, local), kv_caches, meta)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                r = local if layer.local_rope else rope
                x, delta = layer(x, delta, r, kv_cache, meta, self.ops, self.linear_min_rows, self.reduce)
        return self.ops.rms_norm(x, self.norm, self.cfg.rms_norm_eps, delta)[0]

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in_features, out_features) of every distinct linear the model runs, for the kernels' probe."""
        shapes = (packed_shape(w)[:2][::-1] if is_packed(w) else (w.shape[1], w.shape[0]) for w in self._linears())
        return sorted(set(shapes))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, D] for the rows that sample only (a prompt's other rows never reach the vocab matmul,
        the largest one in a small model). Returns float32 [S, V]."""
        head = self.lm_head if self.packed_head is None else self.packed_head
        logits = padded_linear(hidden, head, self.linear_min_rows).float()
        if self.cfg.final_softcap is not None:  # Gemma 2
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits

    def pack_linears(self, cpu_kernel: bool = False) -> None:
        """Pack every linear's weight for its kernel, once the weights are loaded: the unpacked parameters
        stay (the embedding, the model cache and tests read them). `cpu_kernel`: Headroom's bf16 kernel
        (engine/model/cpu_kernels.py), else oneDNN where it runs bf16, else torch's default."""
        for layer in self.layers:
            layer.pack_linears(cpu_kernel)
        self.packed_head = None if self.lm_head is None else linear_weight(self.lm_head.detach(), cpu_kernel)

    def load_hf_weights(self, weights: dict[str, torch.Tensor | RawQuant], quantization: str | None = None) -> None:
        """engine/model/checkpoint.py `load_hf_weights` into this model."""
        load_hf_weights(self, weights, quantization)

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
                    assign(self.get_submodule(module), leaf, w)
            self.load_state_dict(state, assign=True)
        except (RuntimeError, TypeError, AttributeError, KeyError) as e:  # missing, unexpected or misshapen weights
            raise ValueError(str(e)) from e
        if self.cfg.tie_word_embeddings:
            self.lm_head = self.embed
