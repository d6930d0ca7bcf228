"""`--dtype auto`: bf16 only where the CPU has bf16 dot products that oneDNN may use, fp32 elsewhere, bf16
on CUDA; decided from CPU facts, which these tests fake."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.dtype_choice import CpuFacts, choose_dtype, choose_kv_dtype, read_cpu_facts

CPU = torch.device("cpu")
XEON_AMX = CpuFacts("Intel Xeon Platinum 8480+", frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"}), True, None)
EPYC_BF16 = CpuFacts("AMD EPYC 9B14", frozenset({"avx2", "avx512f", "avx512_bf16"}), True, None)
ZEN1_AVX2 = CpuFacts("AMD EPYC 7B12", frozenset({"avx2", "fma"}), False, None)
SKYLAKE_AVX512 = CpuFacts("Intel Xeon Gold 6148", frozenset({"avx2", "avx512f", "avx512bw"}), True, None)


@pytest.mark.parametrize(
    ("facts", "dtype", "why"),
    [
        (XEON_AMX, torch.bfloat16, "amx_bf16 with oneDNN"),
        (EPYC_BF16, torch.bfloat16, "avx512_bf16 with oneDNN"),
        (ZEN1_AVX2, torch.float32, "no AMX-BF16 or AVX512-BF16"),
        # AVX-512 without bf16 dot products: oneDNN runs bf16, but by conversion, not fast
        (SKYLAKE_AVX512, torch.float32, "no AMX-BF16 or AVX512-BF16"),
        (CpuFacts("x", EPYC_BF16.flags, True, "AVX2"), torch.float32, "ONEDNN_MAX_CPU_ISA=AVX2"),
        (CpuFacts("x", EPYC_BF16.flags, True, "avx512_core"), torch.float32, "ONEDNN_MAX_CPU_ISA=avx512_core"),
        (CpuFacts("x", EPYC_BF16.flags, True, "AVX512_CORE_BF16"), torch.bfloat16, "avx512_bf16 with oneDNN"),
        (CpuFacts("x", EPYC_BF16.flags, False, None), torch.float32, "oneDNN does not run bf16"),
    ],
)
def test_auto_on_cpu_follows_the_bf16_facts(facts, dtype, why):
    choice = choose_dtype("auto", CPU, facts)
    assert choice.dtype == dtype
    assert why in choice.reason and facts.model in choice.reason


def test_auto_on_cuda_is_bf16_whatever_the_cpu():
    choice = choose_dtype("auto", torch.device("cuda"), ZEN1_AVX2)
    assert choice.dtype == torch.bfloat16 and "CUDA" in choice.reason


@pytest.mark.parametrize(("name", "dtype"), [("float32", torch.float32), ("bf16", torch.bfloat16)])
def test_an_explicit_dtype_is_kept(name, dtype):
    assert choose_dtype(name, CPU, XEON_AMX if dtype == torch.float32 else ZEN1_AVX2).dtype == dtype


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        choose_dtype("int3", CPU, EPYC_BF16)


def test_cpu_facts_are_read_from_cpuinfo(tmp_path: Path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    processor = "processor\t: {}\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu avx2 avx512_bf16\n\n"
    cpuinfo.write_text(processor.format(0) + processor.format(1))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("HEADROOM_CPU_ISA", raising=False)  # scripts/test_avx2.sh sets it
    facts = read_cpu_facts(cpuinfo)
    assert facts.model == "AMD EPYC 9B14"
    assert facts.flags == {"fpu", "avx2", "avx512_bf16"}
    assert facts.onednn_max_isa == "AVX2"


def test_without_cpuinfo_auto_takes_fp32(tmp_path: Path):
    facts = read_cpu_facts(tmp_path / "missing")
    assert facts.flags == frozenset()
    assert choose_dtype("auto", CPU, facts).dtype == torch.float32


def test_the_avx2_cap_hides_avx512_and_amx(tmp_path: Path, monkeypatch):
    """HEADROOM_CPU_ISA=avx2: every choice made as on an AVX2-only CPU (scripts/test_avx2.sh)."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: X\nflags\t\t: fpu avx2 fma avx512f avx512_bf16 avx512_vnni amx_bf16\n")
    monkeypatch.setenv("HEADROOM_CPU_ISA", "avx2")
    facts = read_cpu_facts(cpuinfo)
    assert facts.flags == {"fpu", "avx2", "fma"}
    assert choose_dtype("auto", CPU, facts).dtype == torch.float32
    monkeypatch.setenv("HEADROOM_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="HEADROOM_CPU_ISA='avx512': use one of native, avx2"):
        read_cpu_facts(cpuinfo)


@pytest.mark.parametrize(
    ("requested", "model", "model_auto", "attention", "kv"),
    [
        ("auto", torch.float32, True, "cpu", torch.float16),  # an AVX2 CPU: fp32 compute, fp16 KV
        ("auto", torch.float32, False, "cpu", torch.float32),  # --dtype float32 asked for fp32 throughout
        ("auto", torch.float32, True, "sdpa", torch.float32),  # plain torch attends in the cache's dtype
        ("auto", torch.bfloat16, True, "cpu", torch.bfloat16),
        ("float16", torch.bfloat16, True, "cpu", torch.float16),
        ("float32", torch.float32, True, "cpu", torch.float32),
        ("bfloat16", torch.bfloat16, False, "flash", torch.bfloat16),
    ],
)
def test_the_kv_dtype(requested, model, model_auto, attention, kv):
    assert choose_kv_dtype(requested, model, model_auto, attention).dtype == kv


@pytest.mark.parametrize(("requested", "attention"), [("float16", "sdpa"), ("bfloat16", "cpu"), ("float32", "cpu")])
def test_a_kv_dtype_the_kernel_cannot_convert_to_is_refused(requested, attention):
    with pytest.raises(ValueError, match="needs the CPU attention kernel"):
        choose_kv_dtype(requested, torch.float16 if requested != "float16" else torch.float32, False, attention)
