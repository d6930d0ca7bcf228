"""Headroom's CPU kernels (engine/model/csrc/): paged attention, RMSNorm with its residual add, RoPE, SiLU-mul and
GELU-mul, the sampler's plain inverse-CDF draw, the bf16 linears on AVX512-BF16, the fp32 ones on AVX2, and the
quantized ones (engine/model/quant.py).

Why compile at run time: the kernels are built with `-march=native`, so they use the vector units of the CPU
they run on (AVX-512, AVX2, NEON) and the wheel ships no binary per CPU. The sources are plain C++ with no
torch headers (seconds to build), loaded through ctypes, which releases the GIL for each call.
The shared object is cached under Headroom's cache directory (engine/cache_dir.py), named by a hash of the
sources, the flags, the compiler's version and the CPU's flags, so a changed CPU or compiler rebuilds it.
Where no compiler is found or the build fails, `build` says why and the backend runs the model in plain
torch (attention `sdpa`, `TorchOps`) and logs a warning. A build that fails with a compiler present is
marked `failed`: that is a defect to fix, so the tests fail on it rather than skip.

Every kernel computes a row from that row alone, in fp32, with reductions in a fixed order (see the
sources), so a token's result does not depend on what else the batch holds: batch invariance is a property
of these kernels, not a measurement.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.cache_dir import default_cache_dir
from engine.model.dtype_choice import isa_cap, read_cpu_facts
from engine.model.quant import packed_shape

if TYPE_CHECKING:
    from engine.model.attention_metadata import AttentionMetadata, AttentionSpec, KVCache

CSRC = Path(__file__).with_name("csrc")
# in CSRC
SOURCES = (
    "paged_attention.cpp", "elementwise.cpp", "sampling.cpp", "linear.cpp", "linear_f32.cpp", "qlinear.cpp",
    "forward.cpp",
)  # fmt: skip
HEADERS = ("vec.h",)
# -Wno-psabi: without AVX-512, GCC notes that 16-float vectors would be passed differently; none crosses the
# library's boundary
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-Wno-psabi")
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",)}  # $HEADROOM_CPU_ISA (dtype_choice.py): no AVX-512 subset
DTYPES = (torch.bfloat16, torch.float32)
COMPILER_ENV = "CXX"

logger = logging.getLogger("headroom.cpu_kernels")
_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "headroom_paged_attention": [
        _i32, _i32, _p, _i64, _p, _i64, _p, _i64, _p, _p, _p, _p, _i64, _p, _p, _i64, _i32, _i32, _i32, _i32, _f32,
        _i32, _f32, _p, _i32
    ],
    "headroom_rms_norm": [_i32, _p, _p, _p, _p, _p, _i64, _i32, _f32, _i32],
    "headroom_rope": [_i32, _p, _i64, _i64, _i32, _i32, _p, _p, _p, _i32],
    "headroom_silu_mul": [_i32, _p, _p, _i64, _i32, _i32],
    "headroom_gelu_tanh_mul": [_i32, _p, _p, _i64, _i32, _i32],
    "headroom_sample_plain": [_p, _i64, _i64, _p, _p, _p, _i32],
    "headroom_linear_bf16": [_p, _i64, _p, _p, _i64, _i64, _i64, _i32],
    "headroom_linear_available": [],
    "headroom_linear_f32": [_p, _i64, _p, _p, _i64, _i64, _i64, _i32],
    "headroom_linear_f32_available": [],
    "headroom_qlinear": [_i32, _p, _i64, _p, _i32, _i32, _p, _i64, _i64, _i64, _i32, _i32],
    "headroom_qrows": [_p, _i32, _i64, _p, _i64, _i32, _p],
    "headroom_qlinear_isa": [],
    "headroom_decoder_layers": [_p],
}  # fmt: skip
# the functions that return something
RESULTS = {name: ctypes.c_int for name in SIGNATURES if name.endswith(("_available", "_isa"))}
LINEAR_BLOCK = 16  # outputs per packed block of the linear kernel (engine/model/csrc/linear.cpp)
ERROR_LINES = 4  # the compiler's first error lines a failed build reports: the first error is the cause


@dataclass(frozen=True)
class KernelBuild:
    library: ctypes.CDLL | None
    reason: str  # what was built or loaded, or why not
    # A compiler was found and the build or the load failed: a defect in the sources or the toolchain, which
    # the tests fail on, unlike a machine without a compiler, where falling back to torch is the design.
    failed: bool = False


class BuildError(Exception):
    """The compiler rejected the sources; the message is its first error lines."""


def build(cache_root: Path | None = None, compiler: str | None = None, csrc: Path = CSRC) -> KernelBuild:
    """Compile the kernels in `csrc` into the cache (once per sources, flags, compiler and CPU) and load them."""
    compiler = shutil.which(compiler or os.environ.get(COMPILER_ENV, "g++"))
    if compiler is None:
        return KernelBuild(None, "no C++ compiler found (g++ or $CXX)")
    try:
        target = _compiled(compiler, csrc, cache_root or default_cache_dir())
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError, BuildError) as e:
        return KernelBuild(None, f"building the CPU kernels with {Path(compiler).name} failed: {e}", failed=True)
    for name, argtypes in SIGNATURES.items():
        getattr(library, name).argtypes = argtypes
        getattr(library, name).restype = RESULTS.get(name)
    return KernelBuild(library, f"built with {Path(compiler).name} -march=native ({target.name})")


def _compiled(compiler: str, csrc: Path, cache_root: Path) -> Path:
    """The shared object for these sources, flags, compiler and CPU, compiled into the cache unless there."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    cpu = read_cpu_facts()  # -march=native compiles for this CPU: another one rebuilds
    machine = [os.uname().machine, cpu.model, *sorted(cpu.flags)]
    flags = (*FLAGS, *ISA_FLAGS[isa_cap()])
    key = "\n".join([*((csrc / name).read_text() for name in (*SOURCES, *HEADERS)), *flags, version, *machine])
    target = cache_root / "kernels" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / "kernels.so"
        cmd = [compiler, *flags, "-o", str(built), *(str(csrc / name) for name in SOURCES)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise BuildError(first_errors(proc.stderr.replace(f"{csrc}/", "")) or f"exit status {proc.returncode}")
        os.replace(built, target)  # readers see the whole library or none
    return target


def first_errors(stderr: str) -> str:
    """The compiler's first error lines, joined: later errors often follow from the first, and the
    "In function" context lines before it say less than the error itself."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return " | ".join((errors or lines)[:ERROR_LINES])


@functools.cache
def load_library() -> KernelBuild:
    """The kernels for this process, built on first use. Only a build is logged here: why there is none
    is the caller's to report, beside what it falls back to (the backend's warning)."""
    result = build()
    if result.library is not None:
        logger.info("CPU kernels: %s", result.reason)
    return result


def unusable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the kernels run here; else why not."""
    if device.type != "cpu":
        return f"the CPU kernels need the CPU, device is {device.type}"
    if dtype not in DTYPES:
        return f"the CPU kernels run bf16 and fp32, dtype is {str(dtype).removeprefix('torch.')}"
    return load_library().reason if load_library().library is None else None


def head_dim_unsupported(head_dim: int) -> str | None:
    """None when the attention kernel takes this head size (whole 16-float vectors, at most 16 of them)."""
    if head_dim % 16 or head_dim > 256:
        return f"the CPU paged kernel needs a head size that is a multiple of 16 up to 256, the model's is {head_dim}"
    return None


def _lib() -> ctypes.CDLL:
    library = load_library().library
    assert library is not None, "a CPU kernel was called where the kernels did not build"
    return library


def _rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd] with heads and elements contiguous in a row (any row stride), as the kernels read."""
    hd = x.shape[-1]
    return x if x.stride(2) == 1 and x.stride(1) == hd else x.contiguous()


def cpu_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, spec: AttentionSpec
) -> torch.Tensor:
    """engine/model/attention.py `paged_attention` on the C++ kernel: writes k/v into their slots and attends."""
    k_cache, v_cache = kv_cache
    q, k, v = _rows_of_heads(q), _rows_of_heads(k), _rows_of_heads(v)
    tokens, heads, head_dim = q.shape
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype)
    token_seq, token_ctx = meta.token_plan
    tables = meta.block_tables
    _lib().headroom_paged_attention(
        q.dtype == torch.bfloat16, k_cache.dtype == torch.float16, q.data_ptr(), q.stride(0), k.data_ptr(),
        k.stride(0), v.data_ptr(), v.stride(0),
        meta.slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
        token_seq.data_ptr(), token_ctx.data_ptr(), tokens, heads, k_cache.shape[2], head_dim, meta.block_size,
        spec.scale, spec.window or 0, spec.softcap or 0.0, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


class CpuKernelOps:
    """The model's elementwise ops (engine/model/llama.py `TorchOps`) on the C++ kernels, each one call."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.contiguous()
        out = torch.empty_like(x)
        total = x if residual is None else torch.empty_like(x)
        res_ptr = None if residual is None else residual.contiguous().data_ptr()
        sum_ptr = None if residual is None else total.data_ptr()
        _lib().headroom_rms_norm(
            x.dtype == torch.bfloat16, x.data_ptr(), res_ptr, sum_ptr, weight.data_ptr(), out.data_ptr(),
            x.shape[0], x.shape[1], eps, torch.get_num_threads(),
        )  # fmt: skip
        return out, total

    def rope_state(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return cos, sin, positions

    def rope(self, qk: torch.Tensor, state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Rotates qk [T, heads, hd] in place (it is a view of the fresh q/k/v projection) and returns it."""
        cos, sin, positions = state
        assert qk.stride(2) == 1 and qk.stride(1) == qk.shape[2]
        _lib().headroom_rope(
            qk.dtype == torch.bfloat16, qk.data_ptr(), qk.stride(0), qk.shape[0], qk.shape[1], qk.shape[2],
            cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return qk

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return _gated_mul(_lib().headroom_silu_mul, gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return _gated_mul(_lib().headroom_gelu_tanh_mul, gate_up)


def _gated_mul(kernel: Callable[..., None], gate_up: torch.Tensor) -> torch.Tensor:
    """activation(gate) * up for gate_up [T, 2F] (gate first) on one of the gated-MLP kernels."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, width))
    kernel(gate_up.dtype == torch.bfloat16, gate_up.data_ptr(), out.data_ptr(), rows, width, torch.get_num_threads())
    return out


def draw_plain(x: torch.Tensor, temperatures: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """engine/core/sampler.py `draw_plain` (the temperature, then the inverse CDF of the whole row's softmax;
    the argmax at temperature 0) as one kernel call."""
    x, t, u = x.float().contiguous(), temperatures.float().contiguous(), u.float().contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _lib().headroom_sample_plain(
        x.data_ptr(), x.shape[0], x.shape[1], t.data_ptr(), u.data_ptr(), out.data_ptr(), torch.get_num_threads()
    )
    return out


@dataclass(frozen=True)
class PackedLinear:
    """A weight [N, K] in its linear kernel's layout: bf16 [N/16][K/2][16][2] (engine/model/csrc/linear.cpp),
    fp32 [N/16][K][16] (linear_f32.cpp)."""

    blocks: torch.Tensor
    out_features: int
    in_features: int


def linear_unusable_reason(dtype: torch.dtype) -> str | None:
    """None when the model's linears run on Headroom's kernel for `dtype` here (bf16: AVX512-BF16; fp32: AVX2
    with FMA); else why they stay on torch.

    CPUs with AMX-BF16 have AVX512-BF16 too, and take the kernel as well. oneDNN's AMX tiles may run a long
    prefill faster there, but their summation order is theirs: with the kernels, a float model's arithmetic on
    the CPU is Headroom's own, and batch-invariant by construction, on AVX512-BF16 CPUs in bf16 and on AVX2
    CPUs in fp32 (each one's `--dtype auto`), where MKL's sgemm rounds a row differently by the batch's size."""
    if dtype not in (torch.bfloat16, torch.float32):
        return f"the linear kernels run bf16 and fp32, dtype is {str(dtype).removeprefix('torch.')}"
    library = load_library().library
    if library is None:
        return load_library().reason
    if dtype == torch.bfloat16 and not library.headroom_linear_available():
        return "this CPU lacks AVX512-BF16 (the build targets the CPU it runs on)"
    if dtype == torch.float32 and not library.headroom_linear_f32_available():
        return "this CPU lacks AVX2 with FMA (the build targets the CPU it runs on)"
    return None


def pack_linear(weight: torch.Tensor) -> PackedLinear | None:
    """`weight` [N, K] (bf16 or fp32) in its kernel's layout, or None where its shape does not fit (N not a
    multiple of 16, or in bf16 K odd): that linear stays on torch."""
    n, k = weight.shape
    if n % LINEAR_BLOCK or (weight.dtype == torch.bfloat16 and k % 2):
        return None
    if weight.dtype == torch.bfloat16:
        blocks = weight.detach().view(n // LINEAR_BLOCK, LINEAR_BLOCK, k // 2, 2).transpose(1, 2).contiguous()
    else:
        blocks = weight.detach().view(n // LINEAR_BLOCK, LINEAR_BLOCK, k).transpose(1, 2).contiguous()
    return PackedLinear(blocks, n, k)


def cpu_linear(x: torch.Tensor, weight: PackedLinear) -> torch.Tensor:
    """x [T, K] @ weight^T in the weight's dtype, each output summed in one fixed order (batch-invariant)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    dtype = weight.blocks.dtype
    out = torch.empty((x.shape[0], weight.out_features), dtype=dtype)
    kernel = _lib().headroom_linear_bf16 if dtype == torch.bfloat16 else _lib().headroom_linear_f32
    kernel(
        x.data_ptr(), x.stride(0), weight.blocks.data_ptr(), out.data_ptr(), x.shape[0], weight.out_features,
        weight.in_features, torch.get_num_threads(),
    )  # fmt: skip
    return out


QLINEAR_ISAS = {2: "AVX512-VNNI (vpdpbusd)", 1: "AVX2 (vpmaddubsw)", 0: "plain C++"}


def qlinear_isa() -> str:
    """The vector path the quantized kernel was built with on this CPU."""
    return QLINEAR_ISAS[_lib().headroom_qlinear_isa()]


def cpu_qlinear(x: torch.Tensor, packed: torch.Tensor, plain: bool = False) -> torch.Tensor:
    """x [T, K] (bf16 or fp32) @ W^T for a packed quantized W (engine/model/quant.py), in x's dtype: x quantized
    per 32-block to int8, integer block sums, blocks folded in one fixed order (batch-invariant). `plain`: the
    plain C++ path, which gives the same bits (the tests' reference)."""
    n, k, bits = packed_shape(packed)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((x.shape[0], n), dtype=x.dtype)
    bf16 = x.dtype == torch.bfloat16
    _lib().headroom_qlinear(
        bf16, x.data_ptr(), x.stride(0), packed.data_ptr(), bits, bf16, out.data_ptr(), x.shape[0], n, k, plain,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def cpu_qembedding(ids: torch.Tensor, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a packed quantized table, dequantized to `dtype`: the embedding lookup of a model whose
    (tied) embedding stays quantized."""
    _, k, bits = packed_shape(packed)
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty((ids.shape[0], k), dtype=dtype)
    bf16 = dtype == torch.bfloat16
    _lib().headroom_qrows(packed.data_ptr(), bits, k, ids.data_ptr(), ids.shape[0], bf16, out.data_ptr())
    return out
