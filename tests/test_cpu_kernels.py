"""The C++ CPU kernels (engine/model/cpu_kernels.py): the elementwise ops against the model's plain-torch ones,
each row computed the same alone and in a batch, the bf16 linear against an fp32 reference and bitwise
batch-invariant, the build cached per machine, a broken build failing the tests, and the fallback to plain
torch (with a warning) where nothing can be built. Paged attention itself is checked in tests/test_model.py
against a dense reference and for bitwise batch invariance, and end to end in tests/test_hf_reference.py.

Where a compiler exists and the kernels do not build, every test here fails (tests/kernel_build.py): a
syntax error in a kernel must not leave the suite green while the server falls back to slower torch."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import pytest
import torch

from engine.backends.torch_backend import TorchBackend
from engine.core.sampler import draw_plain
from engine.model import cpu_kernels
from engine.model.batch_invariance import linear_row_mismatch, linear_weight
from engine.model.cpu_kernels import CpuKernelOps, PackedLinear, build
from engine.model.dtype_choice import CpuFacts
from engine.model.kernel_choice import choose_kernel
from engine.model.llama import TorchOps
from engine.model.loaders.random_model import random_llama
from engine.model.model_config import ModelConfig
from tests.kernel_build import require_cpu_kernels

CPU = torch.device("cpu")
DIM, HEADS, HEAD_DIM, ROWS = 576, 12, 64, 37
# bf16 results: torch rounds between ops, the kernels once at the end; they may differ by a rounding step
# a model whose head size the kernels take (32), small enough to build in a moment
TINY = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                   head_dim=32, max_position_embeddings=64)  # fmt: skip
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


@pytest.fixture(autouse=True)
def kernels_built() -> None:
    require_cpu_kernels()


def case(dtype: torch.dtype, rows: int = ROWS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    angles = torch.rand(256, 1, HEAD_DIM, generator=g) * 6
    return {
        "x": torch.randn(rows, DIM, generator=g).to(dtype),
        "residual": torch.randn(rows, DIM, generator=g).to(dtype),
        "weight": (1 + torch.randn(DIM, generator=g) / 4).to(dtype),
        "qk": torch.randn(rows, HEADS + 2, HEAD_DIM, generator=g).to(dtype),  # a view with a wider row, below
        "cos": angles.cos().to(dtype),
        "sin": angles.sin().to(dtype),
        "positions": torch.randint(0, 256, (rows,), generator=g),
        "gate_up": (torch.randn(rows, 2 * 1536, generator=g) * 4).to(dtype),
    }


def run_ops(ops: TorchOps | CpuKernelOps, c: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    normed, total = ops.rms_norm(c["x"], c["weight"], 1e-5, c["residual"])
    plain, same = ops.rms_norm(c["x"], c["weight"], 1e-5)
    qk = c["qk"].clone()[:, :HEADS]  # rows HEADS + 2 heads apart, as the model's fused projection leaves them
    rotated = ops.rope(qk, ops.rope_state(c["cos"], c["sin"], c["positions"]))
    assert same is c["x"] or torch.equal(same, c["x"])
    return [normed, total, plain, rotated, ops.silu_mul(c["gate_up"])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_ops_match_the_torch_ops(dtype: torch.dtype) -> None:
    c = case(dtype)
    names = ["rms_norm with residual", "residual sum", "rms_norm", "rope", "silu_mul"]
    for name, ours, theirs in zip(names, run_ops(CpuKernelOps(), c), run_ops(TorchOps(), c), strict=True):
        assert ours.dtype == dtype and ours.shape == theirs.shape, name
        torch.testing.assert_close(ours, theirs, **TOLERANCE[dtype], msg=name)
    # the residual sum is one bf16 add either way: exactly torch's
    torch.testing.assert_close(run_ops(CpuKernelOps(), c)[1], c["x"] + c["residual"], atol=0, rtol=0)


def test_each_row_is_the_same_alone_and_in_a_batch() -> None:
    c = case(torch.bfloat16)
    batched = run_ops(CpuKernelOps(), c)
    for row in (0, 5, ROWS - 1):
        alone = run_ops(CpuKernelOps(), {k: v[row : row + 1] if v.shape[0] == ROWS else v for k, v in c.items()})
        for ours, one in zip(batched, alone, strict=True):
            assert torch.equal(ours[row : row + 1], one)


def test_the_build_is_cached_per_machine(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiles = []
    real_run = subprocess.run

    def counting_run(cmd, *args, **kwargs):
        if "-o" in cmd:
            compiles.append(cmd)
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(cpu_kernels.subprocess, "run", counting_run)
    first, second = build(tmp_path), build(tmp_path)
    assert first.library is not None and second.library is not None, first.reason
    assert len(compiles) == 1
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1
    another_cpu = CpuFacts("another cpu", frozenset({"avx2"}), False, None)
    monkeypatch.setattr(cpu_kernels, "read_cpu_facts", lambda: another_cpu)
    assert build(tmp_path).library is not None and len(compiles) == 2


def test_a_kernel_that_does_not_compile_fails_the_tests(tmp_path) -> None:
    """A copy of csrc with a syntax error: the build is reported as failed, with the compiler's first error
    lines, and the tests' helper fails on it rather than skipping."""
    if shutil.which(os.environ.get(cpu_kernels.COMPILER_ENV, "g++")) is None:
        pytest.skip("no C++ compiler here to fail a build with")
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_kernels.CSRC, csrc)
    with (csrc / "elementwise.cpp").open("a") as f:
        f.write("\nint headroom_broken( {\n")
    broken = build(tmp_path / "cache", csrc=csrc)
    assert broken.library is None and broken.failed
    assert "failed" in broken.reason and "elementwise.cpp" in broken.reason and "error" in broken.reason
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))  # nothing half-built is cached
    with pytest.raises(pytest.fail.Exception, match="failed to build with a compiler present"):
        require_cpu_kernels(broken)


def test_without_a_compiler_the_backend_warns_and_runs_plain_torch(tmp_path, monkeypatch, caplog) -> None:
    missing = build(tmp_path, compiler="no-such-compiler-here")
    assert missing.library is None and not missing.failed and "no C++ compiler" in missing.reason
    with pytest.raises(pytest.skip.Exception, match="no C\\+\\+ compiler"):
        require_cpu_kernels(missing)  # a machine without a compiler skips the kernels' tests
    broken = build(tmp_path, compiler="false")  # a "compiler" that fails
    assert broken.library is None and broken.failed and "failed" in broken.reason
    monkeypatch.setattr(cpu_kernels, "load_library", lambda: missing)
    choice = choose_kernel("auto", None, CPU, torch.bfloat16)
    assert (choice.attention, choice.block_size) == ("sdpa", 16) and "no C++ compiler" in choice.reason
    with pytest.raises(ValueError, match="no C\\+\\+ compiler"):
        choose_kernel("cpu", None, CPU, torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="headroom.engine"):
        backend = TorchBackend(random_llama(TINY, torch.float32, "cpu"), dtype="float32", device="cpu", num_blocks=4)
    assert backend.attention == "sdpa" and isinstance(backend.model.ops, TorchOps)
    assert any(r.levelno == logging.WARNING and "no C++ compiler" in r.getMessage() for r in caplog.records)


def test_asking_for_sdpa_on_the_cpu_warns(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="headroom.engine"):
        TorchBackend(random_llama(TINY, torch.float32, "cpu"), dtype="float32", device="cpu", num_blocks=4,
                     attention="sdpa")  # fmt: skip
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "CPU kernels off, the model runs in plain torch (slower): --attention sdpa"
    ]


def test_auto_takes_the_cpu_kernels_on_the_cpu_in_bf16_and_fp32_only() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        assert choose_kernel("auto", None, CPU, dtype).attention == "cpu"
    half = choose_kernel("auto", None, CPU, torch.float16)
    assert half.attention == "sdpa" and "float16" in half.reason
    with pytest.raises(ValueError, match="runs on the CPU"):
        choose_kernel("cpu", None, torch.device("cuda"), torch.bfloat16)


def test_a_head_size_the_kernel_cannot_take_runs_on_sdpa(caplog) -> None:
    cfg = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=24, max_position_embeddings=64)  # fmt: skip
    loaded = random_llama(cfg, torch.float32, "cpu")
    with caplog.at_level(logging.WARNING, logger="headroom.engine"):
        backend = TorchBackend(loaded, dtype="float32", device="cpu", num_blocks=4)
    assert backend.attention == "sdpa" and "multiple of 16" in backend.kernel_reason
    assert isinstance(backend.model.ops, TorchOps)
    assert any("multiple of 16" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    with pytest.raises(ValueError, match="multiple of 16"):
        TorchBackend(loaded, dtype="float32", device="cpu", num_blocks=4, attention="cpu")


def test_the_plain_draw_picks_the_tokens_torch_inverts_to() -> None:
    """The kernel's inverse CDF against the sampler's torch one on the same temperatures and uniforms: the same
    token except where a uniform falls within rounding of a boundary between two tokens; the argmax at
    temperature 0; the kernel's division by the temperature rounds as torch's does."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 49152 + 7, generator=g) * 3  # a vocabulary that is not a multiple of 16
    u = torch.rand(300, generator=g)
    t = torch.tensor([1.0, 0.7, 0.0] * 100)
    ours, theirs = cpu_kernels.draw_plain(x, t, u), draw_plain(x, t, u)
    assert (ours == theirs).float().mean() >= 0.99
    assert torch.equal(ours[t == 0], x[t == 0].argmax(dim=-1))
    warm = t == 0.7
    assert torch.equal(ours[warm], cpu_kernels.draw_plain(x[warm] / 0.7, torch.ones(100), u[warm]))
    assert torch.equal(cpu_kernels.draw_plain(x[4:6], t[4:6], u[4:6]), ours[4:6])  # rows alone: the same draws
    peaked = torch.full((2, 100), -1e4)
    peaked[0, 42], peaked[1, 99] = 0.0, 0.0  # all the mass on one token, even at u just below 1
    assert cpu_kernels.draw_plain(peaked, torch.ones(2), torch.tensor([0.999999, 0.0])).tolist() == [42, 99]


@pytest.fixture
def linear_kernel() -> None:
    if (why := cpu_kernels.linear_unusable_reason(torch.bfloat16)) is not None:
        pytest.skip(f"the bf16 linear kernel does not run here: {why}")


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 37])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (34, 80), (1536, 16)])  # 80: a column of 2 blocks at the end
def test_the_linear_kernel_matches_an_fp32_reference(linear_kernel, rows: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    packed = cpu_kernels.pack_linear(w)
    assert packed is not None
    ours = cpu_kernels.cpu_linear(x, packed)
    reference = (x.float() @ w.float().T).bfloat16()  # fp32 sums in another order: within one bf16 step
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, n)
    torch.testing.assert_close(ours, reference, atol=1e-2, rtol=1e-2)
    strided = torch.randn(rows, k + 6, generator=g).bfloat16()[:, 3 : 3 + k]  # a row stride that is not k
    assert torch.equal(cpu_kernels.cpu_linear(strided, packed), cpu_kernels.cpu_linear(strided.contiguous(), packed))


@pytest.mark.parametrize("rows", [1, 5, 37])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (33, 80), (1536, 16)])
def test_the_fp32_linear_kernel_matches_a_float64_reference(rows: int, k: int, n: int) -> None:
    if (why := cpu_kernels.linear_unusable_reason(torch.float32)) is not None:
        pytest.skip(f"the fp32 linear kernel does not run here: {why}")
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    packed = cpu_kernels.pack_linear(w)
    assert packed is not None and packed.blocks.dtype == torch.float32
    ours = cpu_kernels.cpu_linear(x, packed)
    torch.testing.assert_close(ours.double(), x.double() @ w.double().T, atol=1e-4, rtol=1e-5)
    shapes = [(576, 960), (1536, 576), (576, 49152)]
    assert linear_row_mismatch(shapes, torch.float32, min_rows=1, cpu_kernel=True) is None  # alone = batched


def test_the_linear_kernel_is_batch_invariant_on_the_models_shapes(linear_kernel) -> None:
    """Every probed row bitwise the same alone and in batches of 1-32, 47, 64, 129 and 256 rows, unpadded:
    the property the kernel's fixed summation order gives (the probe itself is tested to catch kernels that
    lack it, tests/test_batch_invariance.py)."""
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
    assert isinstance(linear_weight(torch.zeros(960, 576, dtype=torch.bfloat16), cpu_kernel=True), PackedLinear)
    assert linear_row_mismatch(shapes, torch.bfloat16, min_rows=1, cpu_kernel=True) is None


def test_linears_the_kernel_cannot_take_stay_on_torch() -> None:
    assert cpu_kernels.pack_linear(torch.zeros(40, 64, dtype=torch.bfloat16)) is None  # 40 outputs: not 16s
    assert cpu_kernels.pack_linear(torch.zeros(48, 63, dtype=torch.bfloat16)) is None  # an odd input size
    assert not isinstance(linear_weight(torch.zeros(40, 64, dtype=torch.bfloat16), cpu_kernel=True), PackedLinear)
    assert "float16" in cpu_kernels.linear_unusable_reason(torch.float16)


def test_the_default_model_runs_its_bf16_linears_on_the_kernel(linear_kernel) -> None:
    backend = TorchBackend("default", dtype="bfloat16", device="cpu", num_blocks=8, quantization="none")
    assert "linears: the bf16 kernel" in backend.kernel_reason
    assert isinstance(backend.model.packed_head, PackedLinear)
    assert all(isinstance(w, PackedLinear) for layer in backend.model.layers for w in layer.packed)
    plain = TorchBackend("default", dtype="bfloat16", device="cpu", num_blocks=8, attention="sdpa", quantization="none")
    assert "linears: torch (the C++ kernels are off)" in plain.kernel_reason
    assert not isinstance(plain.model.packed_head, PackedLinear)
