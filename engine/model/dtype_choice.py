"""The model's dtype: an explicit name, or `auto`, which takes bf16 only where its matmuls are fast.

On a CPU without bf16 dot-product instructions torch runs bf16 matmuls in its own fp32-accumulating loop,
several times slower than MKL's fp32 (bench/results/engine_cpu.md), so `auto` picks fp32 there. With AMX-BF16 or
AVX512-BF16, and oneDNN allowed to use them, bf16 halves the weights' memory traffic and runs on oneDNN.
On CUDA `auto` is bf16.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

AUTO = "auto"
DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}
# /proc/cpuinfo flags of the instructions that make bf16 matmuls fast (bf16 dot products)
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# ONEDNN_MAX_CPU_ISA values that stop oneDNN below its bf16 dot-product kernels (oneDNN's names)
# HEADROOM_CPU_ISA=avx2 runs this process as on an AVX2-only CPU: the AVX-512 and AMX flags are hidden from
# every choice here, and the C++ kernels are built without them (engine/model/cpu_kernels.py). With torch's
# own caps (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2) it is how the
# suite and the benchmarks run the AVX2 path on a machine that has AVX-512 (scripts/test_avx2.sh).
ISA_ENV = "HEADROOM_CPU_ISA"
ISA_CAPS = {"native": (), "avx2": ("avx512", "amx")}  # flag prefixes each cap hides
ISAS_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})


@dataclass(frozen=True)
class CpuFacts:
    """What the bf16 decision reads about the CPU, gathered once so that tests can pass their own."""

    model: str  # /proc/cpuinfo "model name", for the log
    flags: frozenset[str]  # /proc/cpuinfo flags
    onednn_bf16: bool  # torch's oneDNN says it runs bf16 on this CPU (honours ONEDNN_MAX_CPU_ISA)
    onednn_max_isa: str | None  # ONEDNN_MAX_CPU_ISA, when set

    def summary(self) -> str:
        bf16 = [f for f in BF16_FLAGS if f in self.flags]
        cap = f", ONEDNN_MAX_CPU_ISA={self.onednn_max_isa}" if self.onednn_max_isa else ""
        return f"{self.model or 'unknown CPU'} (bf16 flags: {', '.join(bf16) or 'none'}{cap})"


@functools.cache
def onednn_runs_bf16() -> bool:
    """torch's oneDNN runs bf16 on this CPU (AVX512-BF16, AMX, or AVX-512 BW/VL/DQ emulation); it honours
    ONEDNN_MAX_CPU_ISA. Where it does not, oneDNN cannot even prepack a bf16 weight."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def read_cpu_facts(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuFacts:
    """This machine's facts. Without /proc/cpuinfo (not Linux) no flags are known, so `auto` takes fp32."""
    fields: dict[str, str] = {}
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    hidden = ISA_CAPS[isa_cap()]
    return CpuFacts(
        model=fields.get("model name", ""),
        flags=frozenset(f for f in fields.get("flags", "").split() if not f.startswith(hidden or ("\0",))),
        onednn_bf16=onednn_runs_bf16(),
        onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA"),
    )


def isa_cap() -> str:
    """$HEADROOM_CPU_ISA: native (the default) or avx2."""
    cap = os.environ.get(ISA_ENV, "native").lower() or "native"
    if cap not in ISA_CAPS:
        raise ValueError(f"{ISA_ENV}={cap!r}: use one of {', '.join(ISA_CAPS)}")
    return cap


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use {AUTO!r} or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def cpu_has_fast_bf16(facts: CpuFacts) -> tuple[bool, str]:
    """(fast, why): bf16 is fast when the CPU has bf16 dot products and oneDNN may use them."""
    found = [f for f in BF16_FLAGS if f in facts.flags]
    if not found:
        return False, "no AMX-BF16 or AVX512-BF16 instructions"
    if facts.onednn_max_isa and facts.onednn_max_isa.upper() in ISAS_WITHOUT_BF16:
        return False, f"ONEDNN_MAX_CPU_ISA={facts.onednn_max_isa} keeps oneDNN off its bf16 kernels"
    if not facts.onednn_bf16:
        return False, f"{', '.join(found)} present but torch's oneDNN does not run bf16 here"
    return True, f"{', '.join(found)} with oneDNN"


def choose_dtype(requested: str | torch.dtype, device: torch.device, facts: CpuFacts | None = None) -> DtypeChoice:
    """The dtype to run, and why: `requested` unless it is `auto`. `facts` None: read this machine's."""
    if requested != AUTO:
        return DtypeChoice(resolve_dtype(requested), "requested")
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, "auto: CUDA runs bf16 natively")
    facts = facts or read_cpu_facts()
    fast, why = cpu_has_fast_bf16(facts)
    dtype = torch.bfloat16 if fast else torch.float32
    return DtypeChoice(dtype, f"auto on {device.type}: {why} on {facts.summary()}")


def choose_kv_dtype(requested: str, model: torch.dtype, model_auto: bool, attention: str) -> DtypeChoice:
    """The KV cache's dtype, and why. `auto` stores fp16 where the CPU kernel runs an `auto` fp32 model (a CPU
    without bf16 dot products): a decode step reads its whole context's KV, so half the bytes is half that
    traffic and half the pool's RSS, and F16C (every AVX2 CPU) converts as a block is loaded. An explicit
    `--dtype float32` keeps fp32 KV, as it asks; elsewhere `auto` is the model's dtype. A KV dtype other
    than the model's is converted by the CPU kernel only (engine/model/csrc/paged_attention.cpp)."""
    if requested == AUTO:
        if attention == "cpu" and model == torch.float32 and model_auto:
            return DtypeChoice(torch.float16, "auto: fp16 beside fp32 compute on the CPU kernel (half the KV bytes)")
        return DtypeChoice(model, "auto: the model's dtype")
    kv = resolve_dtype(requested)
    if kv != model and not (attention == "cpu" and kv == torch.float16):
        raise ValueError(
            f"--kv-cache-dtype {requested} with a {str(model).removeprefix('torch.')} model needs the CPU "
            f"attention kernel, which converts to float16 only; attention here is {attention}"
        )
    return DtypeChoice(kv, "requested")
